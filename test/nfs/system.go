package nfs

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/nfs/internal/nfs3"
)

const ganeshaBin = "/usr/bin/ganesha.nfsd"

// packages are the Debian packages the server and the mount helper need.
// They are installed on demand because CI may run on a fresh machine.
var packages = []string{"nfs-ganesha", "nfs-ganesha-vfs", "rpcbind", "fuse3"}

var (
	installMu   sync.Mutex
	installDone bool
)

// EnsurePackages installs whichever of the needed Debian packages are
// missing (apt-get update first, as a fresh machine has no lists). It waits
// for the dpkg lock, since parallel test binaries may install at once.
func EnsurePackages(ctx context.Context) error {
	installMu.Lock()
	defer installMu.Unlock()
	if installDone {
		return nil
	}
	var missing []string
	for _, p := range packages {
		out, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f=${Status}", p).Output()
		if err != nil || !strings.Contains(string(out), "install ok installed") {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		env := append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		lock := "-oDPkg::Lock::Timeout=600"
		for _, args := range [][]string{
			{lock, "update"},
			append([]string{lock, "install", "-y", "--no-install-recommends"}, missing...),
		} {
			cmd := exec.CommandContext(ctx, "apt-get", args...)
			cmd.Env = env
			if out, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("nfs: apt-get %s: %w\n%s", strings.Join(args, " "), err, out)
			}
		}
	}
	for _, f := range []string{ganeshaBin, rpcbindPath()} {
		if _, err := os.Stat(f); err != nil {
			return fmt.Errorf("nfs: %s missing after installing %v: %w", f, packages, err)
		}
	}
	installDone = true
	return nil
}

func rpcbindPath() string {
	for _, p := range []string{"/usr/sbin/rpcbind", "/sbin/rpcbind"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "/usr/sbin/rpcbind"
}

// rpcbind is shared by every Server in this process. We start one only when
// nothing answers on port 111, and stop it only when our last Server stops;
// a portmapper someone else runs is reused and never stopped.
var rpcb struct {
	sync.Mutex
	refs   int
	cmd    *exec.Cmd
	exited chan struct{}
}

func portmapperAlive(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	return nfs3.Ping(ctx, "127.0.0.1:111", 100000, 2) == nil
}

// acquireRPCBind makes sure a portmapper answers on 127.0.0.1:111 and returns
// the function that gives up this caller's share of it.
func acquireRPCBind(ctx context.Context) (release func(), err error) {
	rpcb.Lock()
	defer rpcb.Unlock()
	if rpcb.cmd != nil {
		select {
		case <-rpcb.exited: // ours died (or was killed by someone): start anew
			rpcb.cmd, rpcb.exited, rpcb.refs = nil, nil, 0
		default:
		}
	}
	if rpcb.cmd == nil {
		if portmapperAlive(ctx) {
			return func() {}, nil // someone else's: reuse, never stop
		}
		// -f: foreground, our child. (-h 127.0.0.1 crashes this rpcbind.)
		cmd := exec.Command(rpcbindPath(), "-f")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("nfs: starting rpcbind: %w", err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for !portmapperAlive(ctx) {
			select {
			case <-exited:
				return nil, fmt.Errorf("nfs: rpcbind exited at start-up (is port 111 taken?)")
			case <-ctx.Done():
				_ = cmd.Process.Kill()
				<-exited
				return nil, fmt.Errorf("nfs: waiting for rpcbind: %w", ctx.Err())
			case <-tick.C:
			}
		}
		rpcb.cmd, rpcb.exited = cmd, exited
		debugf("started rpcbind pid %d", cmd.Process.Pid)
	}
	rpcb.refs++
	cmd := rpcb.cmd
	var once sync.Once
	return func() { once.Do(func() { releaseRPCBind(cmd) }) }, nil
}

func releaseRPCBind(cmd *exec.Cmd) {
	rpcb.Lock()
	defer rpcb.Unlock()
	if rpcb.cmd != cmd { // it was replaced after dying; nothing of ours to stop
		return
	}
	rpcb.refs--
	if rpcb.refs > 0 {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-rpcb.exited:
	case <-time.After(5 * time.Second):
		_ = cmd.Process.Kill()
		<-rpcb.exited
	}
	rpcb.cmd, rpcb.exited = nil, nil
}
