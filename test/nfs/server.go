// Package nfs starts a real NFS server (NFS-Ganesha with the VFS backend) for
// tests and builds the test-only FUSE mount helper (cmd/nfs-fuse-mount) that
// stands in for the kernel NFS client on machines that have none.
//
// Typical use:
//
//	srv, err := nfs.Start(ctx, nfs.Options{})
//	defer srv.Stop()
//	helper, err := nfs.BuildMountHelper(ctx)
//	m := mount.New(helper) // k8s.io/mount-utils
//	err = m.Mount(srv.Source("sub"), target, "nfs", append([]string{"vers=3"}, srv.MountOptions()...))
//
// The server listens on 127.0.0.1 only, on ports leased from 20000-31999 at
// start (so several servers and test binaries can run at once; see
// leasePort); Server.MountOptions gives the port= and mountport= options
// that make a mount independent of the shared portmapper, whose
// registrations the last-started server owns. Kill/Resume, Restart and
// Pause/Unpause simulate a crashed, restarted and hung server.
package nfs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/template"
	"time"

	"github.com/dirpv/dirpv/test/nfs/internal/nfs3"
)

// Squash settings for Options.Squash.
const (
	SquashNone = "none"
	SquashRoot = "root_squash"
)

// DefaultStartTimeout bounds Start and Resume when the context has no deadline.
const DefaultStartTimeout = 30 * time.Second

// stopGrace is how long Stop waits after SIGTERM before SIGKILL. Ganesha's
// clean shutdown normally takes well under a second.
const stopGrace = 10 * time.Second

// Options configure Start. The zero value is a usable, temporary server.
type Options struct {
	// ExportDir is the server-side directory to export. If empty, a temp dir
	// (mode 0777, so squashed users can write) is made and removed by Stop.
	ExportDir string
	// Squash is SquashNone (default) or SquashRoot.
	Squash string
	// WorkDir holds ganesha.conf, ganesha.log and the pid file. If empty, a
	// temp dir is made and removed by Stop.
	WorkDir string
	// Share is the export's pseudo path, used by NFSv4 and (Mount_Path_Pseudo)
	// by NFSv3 MOUNT. Default "/export".
	Share string
	// Port and MountPort pin the NFS and MOUNT ports; 0 picks free ones.
	Port, MountPort int
}

// Server is a running (or killed, see Kill) NFS-Ganesha.
type Server struct {
	// Addr is the address clients use: "127.0.0.1".
	Addr string
	// Share is the export's pseudo path, e.g. "/export".
	Share string
	// ExportDir is the server-side directory behind Share; tests read it to
	// check what went through NFS.
	ExportDir string
	// WorkDir holds ganesha.conf, ganesha.log (LogPath) and ganesha.pid.
	WorkDir string
	// Port and MountPort are the TCP ports of the NFS and MOUNT services.
	Port, MountPort int

	squash      string
	recoveryDir string
	removeDirs  []string // temp dirs we made, removed by Stop

	mu         sync.Mutex
	proc       *exec.Cmd
	exited     chan struct{} // closed when proc has been reaped
	releaseRPC func()
	leases     []*os.File // port leases (flocks), see leasePort
	stopped    bool
}

// Start installs missing Debian packages, starts rpcbind if none is
// listening, writes the config and starts ganesha.nfsd in the foreground as
// a child process, and returns once the NFSv3, MOUNT and NFSv4 services
// answer a NULL call.
func Start(ctx context.Context, opts Options) (_ *Server, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("nfs: starting NFS-Ganesha needs root")
	}
	if err := EnsurePackages(ctx); err != nil {
		return nil, err
	}
	s := &Server{Addr: "127.0.0.1", Share: opts.Share, ExportDir: opts.ExportDir, WorkDir: opts.WorkDir,
		Port: opts.Port, MountPort: opts.MountPort, squash: opts.Squash}
	defer func() {
		if err != nil {
			if s.releaseRPC != nil {
				s.releaseRPC()
			}
			s.releasePorts()
			_ = s.cleanupDirs()
		}
	}()
	if s.Share == "" {
		s.Share = "/export"
	}
	if !strings.HasPrefix(s.Share, "/") || path.Clean(s.Share) != s.Share {
		return nil, fmt.Errorf("nfs: share %q must be a clean absolute path", s.Share)
	}
	switch s.squash {
	case "":
		s.squash = SquashNone
	case SquashNone, SquashRoot:
	default:
		return nil, fmt.Errorf("nfs: unknown squash %q (want %q or %q)", s.squash, SquashNone, SquashRoot)
	}
	if s.ExportDir == "" {
		d, err := os.MkdirTemp("", "dirpv-nfs-export-")
		if err != nil {
			return nil, fmt.Errorf("nfs: creating export dir: %w", err)
		}
		s.removeDirs = append(s.removeDirs, d)
		// 0777: with root_squash, clients write as the anonymous user.
		if err := os.Chmod(d, 0o777); err != nil {
			return nil, fmt.Errorf("nfs: chmod export dir: %w", err)
		}
		s.ExportDir = d
	} else if st, err := os.Stat(s.ExportDir); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("nfs: export dir %s is not a directory: %v", s.ExportDir, err)
	}
	if s.ExportDir, err = filepath.Abs(s.ExportDir); err != nil {
		return nil, fmt.Errorf("nfs: export dir: %w", err)
	}
	if s.WorkDir == "" {
		d, err := os.MkdirTemp("", "dirpv-nfs-work-")
		if err != nil {
			return nil, fmt.Errorf("nfs: creating work dir: %w", err)
		}
		s.removeDirs = append(s.removeDirs, d)
		s.WorkDir = d
	} else if err := os.MkdirAll(s.WorkDir, 0o755); err != nil {
		return nil, fmt.Errorf("nfs: creating work dir: %w", err)
	}
	// The NFSv4 recovery dir lives in its own temp dir, so that a WorkDir
	// shared between runs never carries client state across them.
	if s.recoveryDir, err = os.MkdirTemp("", "dirpv-nfs-recovery-"); err != nil {
		return nil, fmt.Errorf("nfs: creating recovery dir: %w", err)
	}
	s.removeDirs = append(s.removeDirs, s.recoveryDir)
	// Retry when ganesha exits during start-up: the portmapper may have gone
	// away (another test process stopped it) while ganesha registered.
	for attempt := 1; ; attempt++ {
		err = s.start(ctx)
		if err == nil || !errors.Is(err, errExited) || attempt == 3 {
			break
		}
		debugf("start attempt %d failed: %v", attempt, err)
	}
	if err != nil {
		return nil, err
	}
	return s, nil
}

// LogPath is Ganesha's log file.
func (s *Server) LogPath() string { return filepath.Join(s.WorkDir, "ganesha.log") }

// ConfigPath is the generated ganesha.conf.
func (s *Server) ConfigPath() string { return filepath.Join(s.WorkDir, "ganesha.conf") }

// Source is the mount source for a directory below the share, e.g.
// Source("a/b") == "127.0.0.1:/export/a/b"; Source("") is the share itself.
func (s *Server) Source(sub string) string {
	return s.Addr + ":" + path.Join(s.Share, sub)
}

// MountOptions are the options that point a mount straight at this server's
// ports (valid for kernel mount.nfs and nfs-fuse-mount alike). Without them
// the client asks rpcbind, which only knows the most recently started server.
func (s *Server) MountOptions() []string {
	return []string{"port=" + strconv.Itoa(s.Port), "mountport=" + strconv.Itoa(s.MountPort)}
}

var confTmpl = template.Must(template.New("conf").Parse(`# Generated by github.com/dirpv/dirpv/test/nfs for tests.
NFS_CORE_PARAM {
	Bind_addr = 127.0.0.1;
	NFS_Port = {{.Port}};
	MNT_Port = {{.MountPort}};
	Enable_NLM = false;
	Enable_RQUOTA = false;
	Enable_UDP = false;
	Protocols = 3, 4;
	# NFSv3 MOUNT uses the pseudo path, so v3 and v4 clients name the same share.
	Mount_Path_Pseudo = true;
}
NFSV4 {
	# No grace period: a restarted server serves at once (tests restart it).
	Graceless = true;
	RecoveryBackend = fs;
	RecoveryRoot = "{{.Recovery}}";
}
EXPORT_DEFAULTS {
	Anonymous_Uid = 65534;
	Anonymous_Gid = 65534;
}
EXPORT {
	Export_Id = 1;
	Path = "{{.ExportDir}}";
	Pseudo = "{{.Share}}";
	Access_Type = RW;
	Squash = {{.Squash}};
	SecType = sys;
	Protocols = 3, 4;
	Transports = TCP;
	FSAL { Name = VFS; }
}
LOG {
	Default_Log_Level = EVENT;
}
`))

func (s *Server) writeConfig() error {
	for _, p := range []string{s.ExportDir, s.recoveryDir, s.Share} {
		if strings.ContainsAny(p, "\"\n;{}") {
			return fmt.Errorf("nfs: path %q cannot be written into ganesha.conf", p)
		}
	}
	squash := "No_Root_Squash"
	if s.squash == SquashRoot {
		squash = "Root_Squash"
	}
	var b bytes.Buffer
	if err := confTmpl.Execute(&b, map[string]any{
		"Port": s.Port, "MountPort": s.MountPort, "Recovery": s.recoveryDir,
		"ExportDir": s.ExportDir, "Share": s.Share, "Squash": squash,
	}); err != nil {
		return fmt.Errorf("nfs: rendering ganesha.conf: %w", err)
	}
	if err := os.WriteFile(s.ConfigPath(), b.Bytes(), 0o644); err != nil {
		return fmt.Errorf("nfs: writing ganesha.conf: %w", err)
	}
	return nil
}

// start runs ganesha.nfsd and waits until it serves.
func (s *Server) start(ctx context.Context) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultStartTimeout)
		defer cancel()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		return errors.New("nfs: server is already running")
	}
	// One start at a time across processes: Ganesha unregisters and
	// re-registers its programs with the shared portmapper at start-up,
	// and two doing so at once makes one fail ("Cannot register NFS V3").
	unlock, err := lockState(ctx, "ganesha-start.lock")
	if err != nil {
		return err
	}
	defer unlock()
	if s.leases == nil { // first start: lease ports for the Server's lifetime
		if err := s.leasePorts(); err != nil {
			return err
		}
		if err := s.writeConfig(); err != nil {
			return err
		}
	}
	// NFSv3 needs the portmapper: Ganesha registers with it at start.
	// acquireRPCBind also restarts one that went away since (on Resume).
	rel, err := acquireRPCBind(ctx)
	if err != nil {
		return err
	}
	if s.releaseRPC != nil {
		s.releaseRPC() // keep one share per Server
	}
	s.releaseRPC = rel
	out, err := os.OpenFile(filepath.Join(s.WorkDir, "ganesha.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("nfs: opening ganesha.out: %w", err)
	}
	defer out.Close()
	// -F: foreground, so the process is our child and its PID is ours to signal.
	cmd := exec.Command(ganeshaBin, "-F", "-f", s.ConfigPath(), "-L", s.LogPath(),
		"-p", filepath.Join(s.WorkDir, "ganesha.pid"))
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Dir = s.WorkDir
	// Pdeathsig: a test binary that dies must not leave a server behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	started := time.Now()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("nfs: starting %s: %w", ganeshaBin, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	s.proc, s.exited = cmd, exited

	if err := s.waitReady(ctx, exited); err != nil {
		s.killLocked()
		return fmt.Errorf("nfs: ganesha did not become ready: %w\n--- %s (tail) ---\n%s",
			err, s.LogPath(), tail(s.LogPath(), 30))
	}
	debugf("ganesha pid %d ready on 127.0.0.1:%d (mount %d) in %s", cmd.Process.Pid, s.Port, s.MountPort, time.Since(started).Round(time.Millisecond))
	return nil
}

// waitReady polls the services with NULL calls until all answer.
func (s *Server) waitReady(ctx context.Context, exited <-chan struct{}) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	nfsAddr := net.JoinHostPort(s.Addr, strconv.Itoa(s.Port))
	mntAddr := net.JoinHostPort(s.Addr, strconv.Itoa(s.MountPort))
	var last error
	for {
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		last = nfs3.Ping(pctx, nfsAddr, 100003, 3)
		if last == nil {
			last = nfs3.Ping(pctx, nfsAddr, 100003, 4)
		}
		if last == nil {
			last = nfs3.Ping(pctx, mntAddr, 100005, 3)
		}
		cancel()
		if last == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("%w (last probe: %v)", errExited, last)
		case <-ctx.Done():
			return fmt.Errorf("%w (last probe: %v)", ctx.Err(), last)
		case <-tick.C:
		}
	}
}

var errExited = errors.New("ganesha.nfsd exited during start-up")

// Kill SIGKILLs the server, as a crash would: clients see connection
// refused until Resume. Export, work dir, ports and rpcbind are kept.
func (s *Server) Kill() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return errors.New("nfs: server is not running")
	}
	s.killLocked()
	return nil
}

func (s *Server) killLocked() {
	if s.proc == nil {
		return
	}
	_ = s.proc.Process.Kill()
	<-s.exited
	s.proc, s.exited = nil, nil
}

// Pause freezes the server with SIGSTOP: connections are still accepted by
// the kernel but nothing answers, the nastiest failure for a client (a hung
// server rather than a refused connection). It returns once every thread
// is stopped, so nothing is answered after it returns. Unpause continues it.
func (s *Server) Pause() error {
	if err := s.signal(syscall.SIGSTOP); err != nil {
		return err
	}
	s.mu.Lock()
	pid := s.proc.Process.Pid
	s.mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !allThreadsStopped(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("nfs: ganesha pid %d did not stop within 10s", pid)
		}
		<-tick.C
	}
	return nil
}

// allThreadsStopped reports whether every thread of pid is in state T.
func allThreadsStopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, t.Name()))
		if err != nil {
			return false
		}
		st := string(b)
		i := strings.LastIndexByte(st, ')')
		if i < 0 || i+2 >= len(st) || st[i+2] != 'T' {
			return false
		}
	}
	return true
}

// Unpause continues a paused server (SIGCONT).
func (s *Server) Unpause() error { return s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return errors.New("nfs: server is not running")
	}
	if err := s.proc.Process.Signal(sig); err != nil {
		return fmt.Errorf("nfs: signalling ganesha: %w", err)
	}
	return nil
}

// Resume starts a killed server again on the same export and ports. Ganesha
// VFS file handles survive restarts, so existing mounts recover.
func (s *Server) Resume(ctx context.Context) error {
	s.mu.Lock()
	stopped := s.stopped
	s.mu.Unlock()
	if stopped {
		return errors.New("nfs: server was stopped; use Start")
	}
	return s.start(ctx)
}

// Restart stops the server gracefully (SIGTERM) and starts it again.
func (s *Server) Restart(ctx context.Context) error {
	s.mu.Lock()
	s.terminateLocked()
	s.mu.Unlock()
	return s.Resume(ctx)
}

// terminateLocked sends SIGTERM, then SIGKILL after stopGrace.
func (s *Server) terminateLocked() {
	if s.proc == nil {
		return
	}
	_ = s.proc.Process.Signal(syscall.SIGTERM)
	_ = s.proc.Process.Signal(syscall.SIGCONT) // a paused server would not see SIGTERM
	select {
	case <-s.exited:
	case <-time.After(stopGrace):
		_ = s.proc.Process.Kill()
		<-s.exited
	}
	s.proc, s.exited = nil, nil
}

// Stop terminates the server (SIGTERM, then SIGKILL), releases rpcbind if we
// started it, and removes the temp dirs Start made. Safe to call twice.
func (s *Server) Stop() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped {
		return nil
	}
	s.stopped = true
	s.terminateLocked()
	if s.releaseRPC != nil {
		s.releaseRPC()
		s.releaseRPC = nil
	}
	s.releasePorts()
	return s.cleanupDirs()
}

func (s *Server) leasePorts() error {
	for _, p := range []*int{&s.Port, &s.MountPort} {
		port, f, err := leasePort(*p)
		if err != nil {
			s.releasePorts()
			return err
		}
		*p = port
		s.leases = append(s.leases, f)
	}
	return nil
}

func (s *Server) releasePorts() {
	for _, f := range s.leases {
		f.Close()
	}
	s.leases = nil
}

func (s *Server) cleanupDirs() error {
	var errs []error
	for _, d := range s.removeDirs {
		if err := os.RemoveAll(d); err != nil {
			errs = append(errs, fmt.Errorf("nfs: removing %s: %w", d, err))
		}
	}
	s.removeDirs = nil
	return errors.Join(errs...)
}

func tail(file string, n int) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func debugf(format string, args ...any) {
	if os.Getenv("DIRPV_NFS_DEBUG") != "" {
		fmt.Fprintf(os.Stderr, "nfs: "+format+"\n", args...)
	}
}
