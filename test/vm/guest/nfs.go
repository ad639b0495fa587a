package guest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/framework"
)

// Export options for NFSServer.Export. Every export also gets rw, no_subtree_check and
// insecure (test clients may use unprivileged ports).
const (
	NoRootSquash = "no_root_squash"
	RootSquash   = "root_squash"
	// V4Root makes the export the root of the NFSv4 pseudo file system: NFSv4 clients mount
	// it as server:/, NFSv3 clients by its path. NFSv4 needs it in the guest: without an
	// fsid=0 export, an NFSv4 mount of an export by its path failed with ENOENT (exports on
	// tmpfs below the overlay root; mountd's automatic pseudo root did not reach them). Only
	// one export at a time can be the root.
	V4Root = "fsid=0,crossmnt"
)

// Server address of the guest's NFS server: its loopback.
const NFSAddr = "127.0.0.1"

// nfsThreads is the number of nfsd threads; rpc.nfsd 0 stops them all.
const nfsThreads = 4

// The NFSv4 lease and grace times are at the kernel's 10 s minimum: a (re)started server
// refuses NFSv4 opens for the grace time, which would otherwise be 90 s.
const leaseSeconds = "10"

// cmdTimeout bounds each nfs-utils command; they are local and quick when the guest is well.
const cmdTimeout = time.Minute

// NFSServer is the guest's kernel NFS server (nfsd with rpcbind and rpc.mountd from the
// host's nfs-kernel-server and rpcbind packages), serving on the guest's loopback.
// There is one per guest: the kernel has one nfsd.
type NFSServer struct {
	mu      sync.Mutex
	exports map[string]string // dir -> options
	daemons []*exec.Cmd       // rpcbind, rpc.mountd, in the foreground as our children
	nextID  int
	stopped bool
}

// StartNFS starts rpcbind, mounts the nfsd file system, and starts rpc.mountd and nfsd, and
// returns once the server answers NFSv3 and NFSv4 NULL calls. Add exports with Export.
func StartNFS(ctx context.Context) (_ *NFSServer, err error) {
	if !InVM() {
		return nil, errors.New("guest: the kernel NFS server is started only inside the test VM")
	}
	s := &NFSServer{exports: map[string]string{}, nextID: 1}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if err := os.MkdirAll("/proc/fs/nfsd", 0o755); err != nil {
		return nil, fmt.Errorf("guest: %w", err)
	}
	if !mounted("/proc/fs/nfsd") {
		if err := run(ctx, cmdTimeout, "mount", "-t", "nfsd", "nfsd", "/proc/fs/nfsd"); err != nil {
			return nil, fmt.Errorf("guest: %w", err)
		}
	}
	if err := s.writeExports(ctx); err != nil {
		return nil, err
	}
	if err := os.MkdirAll("/run/rpcbind", 0o755); err != nil {
		return nil, fmt.Errorf("guest: %w", err)
	}
	if err := s.daemon("rpcbind", "-f", "-w"); err != nil {
		return nil, err
	}
	if err := answers(ctx, "rpcbind", "-p", NFSAddr); err != nil {
		return nil, err
	}
	if err := s.daemon("rpc.mountd", "-F"); err != nil {
		return nil, err
	}
	if err := s.Resume(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// daemon starts a server process in the foreground, as our child, so that Close stops
// exactly it.
func (s *NFSServer) daemon(name string, args ...string) error {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("guest: starting %s: %w", name, err)
	}
	s.daemons = append(s.daemons, cmd)
	return nil
}

// Export exports dir to the guest's loopback with the given options (NoRootSquash or
// RootSquash, V4Root, or any exports(5) option) and returns the function that withdraws it.
// Unless options name an fsid, the export gets one: tmpfs, where tests keep their export
// dirs, has no UUID that nfsd could identify it by.
func (s *NFSServer) Export(ctx context.Context, dir string, options ...string) (unexport func() error, err error) {
	dir, err = filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("guest: %w", err)
	}
	opts := append([]string{"rw", "no_subtree_check", "insecure"}, options...)
	if !slices.ContainsFunc(opts, func(o string) bool { return strings.Contains(o, "fsid=") }) {
		s.mu.Lock()
		opts = append(opts, "fsid="+strconv.Itoa(s.nextID))
		s.nextID++
		s.mu.Unlock()
	}
	s.mu.Lock()
	if _, dup := s.exports[dir]; dup {
		s.mu.Unlock()
		return nil, fmt.Errorf("guest: %s is already exported", dir)
	}
	s.exports[dir] = strings.Join(opts, ",")
	s.mu.Unlock()
	if err := s.writeExports(ctx); err != nil {
		return nil, err
	}
	return func() error {
		s.mu.Lock()
		delete(s.exports, dir)
		s.mu.Unlock()
		return s.writeExports(context.Background())
	}, nil
}

// writeExports writes /etc/exports (the guest's, on its overlay) and makes nfsd serve exactly
// it.
func (s *NFSServer) writeExports(ctx context.Context) error {
	s.mu.Lock()
	var b strings.Builder
	for dir, opts := range s.exports {
		fmt.Fprintf(&b, "%s %s(%s)\n", dir, NFSAddr, opts)
	}
	s.mu.Unlock()
	if err := os.WriteFile("/etc/exports", []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("guest: %w", err)
	}
	if err := run(ctx, cmdTimeout, "exportfs", "-ra"); err != nil {
		return fmt.Errorf("guest: %w", err)
	}
	return nil
}

// Kill stops every nfsd thread (rpc.nfsd 0): the server no longer answers, as if it had
// died, and mounts of it hang (hard) or fail (soft). Resume brings it back.
func (s *NFSServer) Kill(ctx context.Context) error {
	if err := run(ctx, cmdTimeout, "rpc.nfsd", "0"); err != nil {
		return fmt.Errorf("guest: %w", err)
	}
	return nil
}

// Resume starts the nfsd threads (again) and waits until NFSv3 and NFSv4 answer.
func (s *NFSServer) Resume(ctx context.Context) error {
	if err := run(ctx, cmdTimeout, "rpc.nfsd", "-G", leaseSeconds, "-L", leaseSeconds, strconv.Itoa(nfsThreads)); err != nil {
		return fmt.Errorf("guest: %w", err)
	}
	for _, v := range []string{"3", "4"} {
		if err := answers(ctx, "nfsd version "+v, "-t", NFSAddr, "nfs", v); err != nil {
			return err
		}
	}
	return nil
}

// answers polls `rpcinfo args...` until it succeeds: the RPC service answers.
func answers(ctx context.Context, what string, args ...string) error {
	err := framework.Poll(ctx, cmdTimeout, func(ctx context.Context) (bool, error) {
		err := run(ctx, 5*time.Second, "rpcinfo", args...)
		return err == nil, err
	})
	if err != nil {
		return fmt.Errorf("guest: waiting for %s to answer: %w", what, err)
	}
	return nil
}

// Close stops nfsd and the daemons StartNFS started.
func (s *NFSServer) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return
	}
	s.stopped = true
	_ = run(context.Background(), cmdTimeout, "rpc.nfsd", "0")
	for i := len(s.daemons) - 1; i >= 0; i-- {
		d := s.daemons[i]
		_ = d.Process.Kill()
		_ = d.Wait()
	}
}

// mounted reports whether dir is a mount point in /proc/self/mounts.
func mounted(dir string) bool {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[1] == dir {
			return true
		}
	}
	return false
}
