package nfs

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/internal/filelock"
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

// rpcbind is shared by every Server in this process and, through lock
// files in stateDir, with every other process using this package (go test
// runs test binaries in parallel). The rules:
//   - a portmapper already answering on port 111 is reused;
//   - otherwise the first user starts `rpcbind -f` and records its PID and
//     start time in stateDir/rpcbind.pid;
//   - every process using it holds a shared flock on stateDir/rpcbind.users;
//   - the last user to leave (the exclusive flock succeeds) stops the
//     recorded rpcbind, so one we did not start is never stopped, and one a
//     crashed test run left behind is cleaned up by the next run.
//
// Start/stop decisions are serialised by an exclusive flock on
// stateDir/rpcbind.lock.
const stateDir = "/run/dirpv-nfs"

var rpcb struct {
	sync.Mutex
	refs  int
	users *os.File // holds our shared flock while refs > 0
}

func portmapperAlive(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	return nfs3.Ping(ctx, "127.0.0.1:111", 100000, 2) == nil
}

// lockState takes an exclusive flock on stateDir/name, polling so that ctx
// is honoured. Closing the returned unlock drops it (so does our death).
func lockState(ctx context.Context, name string) (unlock func(), err error) {
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		return nil, fmt.Errorf("nfs: creating %s: %w", stateDir, err)
	}
	unlock, err = filelock.Lock(ctx, filepath.Join(stateDir, name), 10*time.Millisecond)
	if err != nil {
		return nil, fmt.Errorf("nfs: %w", err)
	}
	return unlock, nil
}

// Test servers take their ports from below the kernel's ephemeral range
// (32768+ here), so no outgoing connection can occupy a port while its
// server is killed and waiting to be resumed. Ganesha binds with
// SO_REUSEPORT, so two servers on one port would both start and silently
// share connections: every port in use is therefore leased through an
// flock on stateDir/ports/<port>, held for the Server's lifetime and
// released by the kernel if the process dies.
const portLo, portHi = 20000, 32000

// leasePort leases port (0 = pick a free one) and returns the lease file.
func leasePort(port int) (int, *os.File, error) {
	dir := filepath.Join(stateDir, "ports")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return 0, nil, fmt.Errorf("nfs: creating %s: %w", dir, err)
	}
	try := func(p int) (*os.File, error) {
		f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_CREATE|os.O_RDWR, 0o644)
		if err != nil {
			return nil, err
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
			f.Close()
			return nil, fmt.Errorf("port %d is leased by another test server", p)
		}
		// Leased, but something outside this package may still use it.
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("port %d is in use: %w", p, err)
		}
		l.Close()
		return f, nil
	}
	if port != 0 {
		f, err := try(port)
		if err != nil {
			return 0, nil, fmt.Errorf("nfs: %w", err)
		}
		return port, f, nil
	}
	for range 200 {
		p := portLo + mrand.IntN(portHi-portLo)
		if f, err := try(p); err == nil {
			return p, f, nil
		}
	}
	return 0, nil, fmt.Errorf("nfs: no free port in [%d, %d)", portLo, portHi)
}

// acquireRPCBind makes sure a portmapper answers on 127.0.0.1:111 and returns
// the function that gives up this caller's share of it.
func acquireRPCBind(ctx context.Context) (release func(), err error) {
	rpcb.Lock()
	defer rpcb.Unlock()
	if rpcb.refs == 0 || !portmapperAlive(ctx) {
		unlock, err := lockState(ctx, "rpcbind.lock")
		if err != nil {
			return nil, err
		}
		defer unlock()
		if rpcb.users == nil {
			f, err := os.OpenFile(filepath.Join(stateDir, "rpcbind.users"), os.O_CREATE|os.O_RDWR, 0o644)
			if err != nil {
				return nil, fmt.Errorf("nfs: opening rpcbind users file: %w", err)
			}
			if err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH); err != nil {
				f.Close()
				return nil, fmt.Errorf("nfs: locking rpcbind users file: %w", err)
			}
			rpcb.users = f
		}
		if !portmapperAlive(ctx) {
			if err := startRPCBind(ctx); err != nil {
				if rpcb.refs == 0 {
					rpcb.users.Close()
					rpcb.users = nil
				}
				return nil, err
			}
		}
	}
	rpcb.refs++
	var once sync.Once
	return func() { once.Do(releaseRPCBind) }, nil
}

// startRPCBind starts `rpcbind -f` and records it. It is deliberately not
// tied to our lifetime (no Pdeathsig): other test processes may be using it
// when we exit, and the last user stops it.
func startRPCBind(ctx context.Context) error {
	cmd := exec.Command(rpcbindPath(), "-f") // (-h 127.0.0.1 crashes this rpcbind)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Dir = "/"
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("nfs: starting rpcbind: %w", err)
	}
	pid := cmd.Process.Pid
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }() // reap it if it exits while we live
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !portmapperAlive(ctx) {
		select {
		case <-exited:
			return fmt.Errorf("nfs: rpcbind exited at start-up (is port 111 taken?)")
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			<-exited
			return fmt.Errorf("nfs: waiting for rpcbind: %w", ctx.Err())
		case <-tick.C:
		}
	}
	id := fmt.Sprintf("%d %s\n", pid, procStartTime(pid))
	if err := os.WriteFile(filepath.Join(stateDir, "rpcbind.pid"), []byte(id), 0o644); err != nil {
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("nfs: recording rpcbind pid: %w", err)
	}
	debugf("started rpcbind pid %d", pid)
	return nil
}

func releaseRPCBind() {
	rpcb.Lock()
	defer rpcb.Unlock()
	rpcb.refs--
	if rpcb.refs > 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	unlock, err := lockState(ctx, "rpcbind.lock")
	if err != nil {
		debugf("not stopping rpcbind: %v", err)
		return
	}
	defer unlock()
	if rpcb.users != nil {
		rpcb.users.Close() // drops our shared lock
		rpcb.users = nil
	}
	f, err := os.OpenFile(filepath.Join(stateDir, "rpcbind.users"), os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer f.Close()
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		return // another process still uses it
	}
	stopRecordedRPCBind()
}

// stopRecordedRPCBind stops the rpcbind in stateDir/rpcbind.pid if that PID
// still is the process we started (same start time), SIGTERM then SIGKILL.
func stopRecordedRPCBind() {
	pidFile := filepath.Join(stateDir, "rpcbind.pid")
	b, err := os.ReadFile(pidFile)
	if err != nil {
		return // not ours: a pre-existing portmapper is never stopped
	}
	defer os.Remove(pidFile)
	var pid int
	var start string
	if _, err := fmt.Sscan(string(b), &pid, &start); err != nil || pid <= 1 {
		return
	}
	if procStartTime(pid) != start {
		return // gone, or the PID was reused by something else
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(5 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for procRunning(pid, start) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			deadline = time.Now().Add(time.Hour)
		}
		<-tick.C
	}
	debugf("stopped rpcbind pid %d", pid)
}

// procStat returns the fields of /proc/pid/stat after the command name.
func procStat(pid int) []string {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(s[i+1:])
}

// procStartTime is field 22 of /proc/pid/stat ("" if the process is gone):
// with the PID it identifies a process across PID reuse.
func procStartTime(pid int) string {
	f := procStat(pid)
	if len(f) < 20 {
		return ""
	}
	return f[19]
}

// procRunning: the process exists and is not a zombie (an exited rpcbind
// whose parent is gone may stay a zombie where PID 1 does not reap).
func procRunning(pid int, start string) bool {
	f := procStat(pid)
	return len(f) >= 20 && f[19] == start && f[0] != "Z"
}
