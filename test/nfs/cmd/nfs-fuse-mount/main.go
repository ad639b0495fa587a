// Command nfs-fuse-mount is a TEST-ONLY stand-in for mount.nfs on machines
// whose kernel has no NFS client. It is handed to k8s.io/mount-utils as the
// mounter path (mount.New(path)), which then runs it as
//
//	nfs-fuse-mount mount -t nfs -o OPT1,OPT2 server:/share/sub /target
//
// (mount-utils v0.37.2 doMount prepends the literal "mount" when a mounter
// path is set). The mount.nfs form "nfs-fuse-mount server:/share/sub /target
// -o OPTS" is accepted too. It speaks NFSv3 to the server and serves the
// directory at /target through FUSE (type fuse.nfs, source server:/share/sub).
//
// The foreground process exits 0 only once the FUSE mount is live, leaving a
// detached daemon that serves it until the target is unmounted (plain
// umount(8) or umount(2) by root). Every NFS call has a deadline, so a dead
// server turns into EIO rather than a hung process, and unmounting a stale
// mount works. Options it cannot honour (vers=, nolock, hard, soft, timeo=,
// ...) are accepted and ignored; "ro" is honoured; "port=" and "mountport="
// bypass the portmapper like they do for mount.nfs. Every option is recorded
// in /run/dirpv-nfs-fuse/<hash>.json (see internal/mountrec) for tests.
//
// Production code never uses this: it mounts with the kernel client.
package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/nfs/internal/mountrec"
)

const (
	// daemonEnv marks the re-executed child that serves the mount.
	daemonEnv = "DIRPV_NFS_FUSE_DAEMON"
	// timeoutEnv overrides the per-operation NFS deadline (a Go duration).
	timeoutEnv = "DIRPV_NFS_FUSE_TIMEOUT"
	// keepLogEnv keeps the daemon log after a clean unmount, for debugging.
	keepLogEnv = "DIRPV_NFS_FUSE_KEEP_LOG"
	// Exit codes of mount(8)/mount.nfs.
	exitUsage = 1
	exitFail  = 32
	// readyTimeout bounds how long the foreground waits for the daemon.
	readyTimeout = 60 * time.Second
)

type mountArgs struct {
	fstype  string
	options []string // raw, in order
	source  string
	target  string

	host      string
	path      string // path on the server, e.g. /export/sub
	readOnly  bool
	port      int // NFS port; 0 = ask the portmapper
	mountPort int // MOUNT port; 0 = ask the portmapper
}

func main() {
	if os.Getenv(daemonEnv) == "1" {
		os.Exit(daemonMain())
	}
	a, err := parseArgs(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "nfs-fuse-mount: %v\n", err)
		fmt.Fprintln(os.Stderr, "usage: nfs-fuse-mount [mount] [-t nfs] [-o opts] server:/path target")
		os.Exit(exitUsage)
	}
	if err := foreground(a); err != nil {
		fmt.Fprintf(os.Stderr, "mount.nfs: %v\n", err)
		os.Exit(exitFail)
	}
}

// parseArgs accepts both the mount(8) argv that mount-utils produces and the
// mount.nfs argv; flags may appear anywhere.
func parseArgs(args []string) (*mountArgs, error) {
	if len(args) > 0 && args[0] == "mount" {
		args = args[1:]
	}
	a := &mountArgs{}
	var pos []string
	for i := 0; i < len(args); i++ {
		s := args[i]
		switch {
		case s == "--":
			pos = append(pos, args[i+1:]...)
			i = len(args)
		case s == "-t" || s == "-o":
			if i+1 >= len(args) {
				return nil, fmt.Errorf("%s needs an argument", s)
			}
			i++
			if s == "-t" {
				a.fstype = args[i]
			} else {
				a.options = append(a.options, splitOpts(args[i])...)
			}
		case strings.HasPrefix(s, "-o") && len(s) > 2:
			a.options = append(a.options, splitOpts(s[2:])...)
		case strings.HasPrefix(s, "-t") && len(s) > 2:
			a.fstype = s[2:]
		case s == "-r":
			a.options = append(a.options, "ro")
		case s == "-w":
			a.options = append(a.options, "rw")
		case strings.HasPrefix(s, "-") && len(s) > 1:
			// -f (fake), -n (no mtab), -v (verbose), -s (sloppy), -i: harmless to ignore.
		default:
			pos = append(pos, s)
		}
	}
	if len(pos) != 2 {
		return nil, fmt.Errorf("want exactly a source and a target, got %q", pos)
	}
	a.source, a.target = pos[0], pos[1]
	switch a.fstype {
	case "", "nfs", "nfs4":
	default:
		return nil, fmt.Errorf("unsupported file system type %q (only nfs)", a.fstype)
	}
	host, p, err := splitSource(a.source)
	if err != nil {
		return nil, err
	}
	a.host, a.path = host, p
	for _, o := range a.options {
		k, v, _ := strings.Cut(o, "=")
		switch k {
		case "ro":
			a.readOnly = true
		case "rw":
			a.readOnly = false
		case "port", "mountport":
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > 65535 {
				return nil, fmt.Errorf("bad %s=%q", k, v)
			}
			if k == "port" {
				a.port = n
			} else {
				a.mountPort = n
			}
		default:
			// vers=, nfsvers=, proto=, nolock, hard, soft, timeo=, retrans=,
			// actimeo=, noatime, sec=sys, ...: a FUSE bridge cannot honour
			// them, and refusing them would make every realistic
			// StorageClass fail in tests. They are recorded all the same.
		}
	}
	return a, nil
}

func splitOpts(s string) []string {
	var out []string
	for _, o := range strings.Split(s, ",") {
		if o = strings.TrimSpace(o); o != "" {
			out = append(out, o)
		}
	}
	return out
}

// splitSource splits "host:/path" (host may be "[v6addr]").
func splitSource(src string) (host, p string, err error) {
	if strings.HasPrefix(src, "[") {
		end := strings.Index(src, "]:")
		if end < 0 {
			return "", "", fmt.Errorf("bad source %q: want [addr]:/path", src)
		}
		host, p = src[1:end], src[end+2:]
	} else {
		var ok bool
		host, p, ok = strings.Cut(src, ":")
		if !ok {
			return "", "", fmt.Errorf("bad source %q: want server:/path", src)
		}
	}
	if host == "" || !strings.HasPrefix(p, "/") {
		return "", "", fmt.Errorf("bad source %q: want server:/path", src)
	}
	return host, filepath.Clean(p), nil
}

// foreground starts the daemon and waits until it reports the mount live
// (or fails). The daemon must not inherit our stdout/stderr: mount-utils
// reads them with CombinedOutput, which would wait for the daemon to exit.
func foreground(a *mountArgs) error {
	abs, err := filepath.Abs(a.target)
	if err != nil {
		return fmt.Errorf("resolving mount point %s: %w", a.target, err)
	}
	a.target = abs
	if st, err := os.Stat(a.target); err != nil {
		return fmt.Errorf("mount point %s does not exist", a.target)
	} else if !st.IsDir() {
		return fmt.Errorf("mount point %s is not a directory", a.target)
	}
	if err := os.MkdirAll(mountrec.Dir, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", mountrec.Dir, err)
	}
	logf, err := os.OpenFile(mountrec.LogPath(a.target), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("opening daemon log: %w", err)
	}
	defer logf.Close()
	pr, pw, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("creating status pipe: %w", err)
	}
	defer pr.Close()
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding own executable: %w", err)
	}
	cmd := exec.Command(self, os.Args[1:]...)
	cmd.Env = append(os.Environ(), daemonEnv+"=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{pw} // fd 3 in the daemon
	cmd.Dir = "/"
	// A new session: the daemon must outlive us and not get our terminal's signals.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		pw.Close()
		return fmt.Errorf("starting daemon: %w", err)
	}
	pw.Close()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	type result struct {
		line string
		err  error
	}
	got := make(chan result, 1)
	go func() {
		line, err := bufio.NewReader(pr).ReadString('\n')
		got <- result{strings.TrimSpace(line), err}
	}()
	select {
	case r := <-got:
		if r.line == "OK" {
			return nil
		}
		msg := strings.TrimPrefix(r.line, "ERR ")
		<-exited
		if msg == "" {
			msg = "daemon exited without a status; see " + mountrec.LogPath(a.target)
		} else {
			// The reason is in our output already; no need to keep the log.
			_ = os.Remove(mountrec.LogPath(a.target))
		}
		return fmt.Errorf("mounting %s failed: %s", a.source, msg)
	case <-time.After(readyTimeout):
		_ = cmd.Process.Kill()
		return fmt.Errorf("mounting %s timed out after %s; see %s", a.source, readyTimeout, mountrec.LogPath(a.target))
	}
}

// daemonMain resolves the export, mounts it and serves until unmounted.
func daemonMain() int {
	status := os.NewFile(3, "status")
	report := func(err error) int {
		fmt.Fprintf(os.Stderr, "%s nfs-fuse-mount: %v\n", time.Now().Format(time.RFC3339), err)
		fmt.Fprintf(status, "ERR %s\n", strings.ReplaceAll(err.Error(), "\n", " "))
		return exitFail
	}
	a, err := parseArgs(os.Args[1:])
	if err != nil {
		return report(err)
	}
	a.target, _ = filepath.Abs(a.target)
	timeout := 5 * time.Second
	if v := os.Getenv(timeoutEnv); v != "" {
		if d, err := time.ParseDuration(v); err == nil && d > 0 {
			timeout = d
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*timeout)
	fsys, err := connect(ctx, a, timeout)
	cancel()
	if err != nil {
		return report(err)
	}
	srv, err := mountFUSE(a, fsys)
	if err != nil {
		return report(fmt.Errorf("mounting FUSE at %s: %w", a.target, err))
	}
	rec := &mountrec.Record{
		Source: a.source, Target: a.target, FSType: a.fstype, Options: a.options,
		ReadOnly: a.readOnly, Server: a.host, NFSAddr: fsys.nfsAddr, MountArg: a.path,
		PID: os.Getpid(), Mounted: time.Now(),
	}
	if rec.FSType == "" {
		rec.FSType = "nfs"
	}
	if rec.Options == nil {
		rec.Options = []string{}
	}
	if err := mountrec.Write(rec); err != nil {
		_ = srv.Unmount()
		return report(err)
	}
	fmt.Fprintln(status, "OK")
	status.Close()
	fmt.Fprintf(os.Stderr, "%s nfs-fuse-mount: serving %s at %s (nfs %s)\n",
		time.Now().Format(time.RFC3339), a.source, a.target, fsys.nfsAddr)

	// SIGTERM/SIGINT: unmount ourselves so no dead FUSE mount is left behind.
	go handleSignals(srv, a.target)
	srv.Wait()
	if r, err := mountrec.Read(a.target); err == nil && r.PID == os.Getpid() {
		_ = os.Remove(mountrec.Path(a.target))
		if os.Getenv(keepLogEnv) == "" {
			_ = os.Remove(mountrec.LogPath(a.target))
		}
	}
	return 0
}

// resolvePort joins host and port, asking the portmapper when port is 0.
func resolvePort(ctx context.Context, host string, port int, prog, vers uint32) (string, error) {
	if port == 0 {
		var err error
		port, err = getPort(ctx, host, prog, vers)
		if err != nil {
			return "", err
		}
	}
	return net.JoinHostPort(host, strconv.Itoa(port)), nil
}
