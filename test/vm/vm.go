// Package vm boots the Debian kernel named by linux-image-amd64 under qemu (TCG) with the
// host's root file system as the guest's root (9p, read-only, under a tmpfs overlay), runs one
// command in it and returns the command's exit status, output and result files. The guest has
// every host binary, a real kernel NFS client and server, loop devices and quota-capable file
// systems, which the host kernel lacks (see ../../../shared/notes/real-kernel-vm.md).
//
//	img, err := vm.Prepare(ctx, os.Stderr) // cached under CacheDir() after the first run
//	res, err := vm.Run(ctx, img, vm.Command{Args: []string{"cat", "/proc/version"}})
//
// Package guest holds the helpers that code running inside the guest uses.
//
// Everything the VM changes stays in the guest: it has no network (unless Command.Network
// attaches it to a tap device in a network namespace the caller made), its loop devices and
// mounts are its own, and qemu, the only host process, is stopped by its PID before Run
// returns. Start runs a guest alongside the caller (a Kubernetes node, package node) until its
// command ends or Machine.Stop asks it to.
package vm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Defaults for Command's deadlines. TCG emulation on a loaded two-core host boots in 10 s when
// idle and takes minutes when busy; both are generous and bounded.
const (
	DefaultBootTimeout = 5 * time.Minute
	DefaultTimeout     = 10 * time.Minute
)

// Command is what Run runs in the guest.
type Command struct {
	// Args is the command line; Args[0] is looked up in the guest's PATH (the host's).
	Args []string
	// Dir is the working directory in the guest (a host path); "" means /.
	Dir string
	// Env holds extra KEY=VALUE pairs. The guest always has DIRPV_IN_VM=1 and
	// DIRPV_VM_RESULTS=GuestResultsDir.
	Env []string
	// BootTimeout bounds the boot up to the start of the command; 0 means DefaultBootTimeout.
	BootTimeout time.Duration
	// Timeout bounds the command; 0 means DefaultTimeout.
	Timeout time.Duration
	// Output, if set, receives the command's output while it runs (Result.Output has it all).
	Output io.Writer
	// Network, if set, gives the guest an eth0 on a tap device of the host; without it the
	// guest has no network but its loopback.
	Network *Network
}

// Network connects the guest's eth0 (virtio-net) to a tap device that the caller created in
// its own network namespace, one that the test made and that dies with it: nothing else is
// reachable from the guest (qemu's user-mode network, which would reach the host's
// networks, is never used).
type Network struct {
	// Tap is the tap device in the calling process's network namespace.
	Tap string
	// Address is the guest's eth0 address with its prefix length, e.g. "192.168.254.2/24".
	Address string
	// Gateway, if set, is the guest's default route: kubelet picks its node address from the
	// interface of the default route.
	Gateway string
}

// Result is what a guest command left.
type Result struct {
	// ExitCode is the command's exit status.
	ExitCode int
	// Output is the command's stdout and stderr.
	Output []byte
	// Files are the files the command wrote to GuestResultsDir, by relative path.
	Files map[string][]byte
	// Console is the guest's serial console (kernel messages and init's errors).
	Console []byte
	// Boot and Run are the time to the start of the command and the command's own time.
	Boot, Run time.Duration
}

// Run boots img, runs cmd in the guest and powers the guest off. An error means the command
// did not run to completion (no boot, deadline, qemu failure); a failing command is a Result
// with a non-zero ExitCode. On a deadline the error comes with the Result so far, whose
// Output and Console say where the guest was.
func Run(ctx context.Context, img *Image, cmd Command) (*Result, error) {
	m, err := Start(ctx, img, cmd)
	if err != nil {
		return nil, err
	}
	return m.Wait()
}

// Machine is a guest started by Start, running its command.
type Machine struct {
	cmd    Command
	share  string
	q      *qemu
	start  time.Time
	booted chan struct{}
	boot   time.Duration
	done   chan struct{}
	res    *Result
	err    error
}

// Start boots img and starts cmd in the guest, for a guest that runs alongside the caller (a
// Kubernetes node): BootTime and Done tell how far it is, Stop asks the command to end, and
// Wait returns what Run would. The guest is stopped when its command ends, a deadline of cmd
// passes or ctx ends, whichever comes first; the caller must call Wait, which returns after
// that.
func Start(ctx context.Context, img *Image, cmd Command) (*Machine, error) {
	if len(cmd.Args) == 0 {
		return nil, errors.New("vm: no command")
	}
	if cmd.BootTimeout <= 0 {
		cmd.BootTimeout = DefaultBootTimeout
	}
	if cmd.Timeout <= 0 {
		cmd.Timeout = DefaultTimeout
	}
	if cmd.Dir == "" {
		cmd.Dir = "/"
	}
	share, err := ownedTempDir("", "dirpv-vm-")
	if err != nil {
		return nil, err
	}
	if err := writeStage2(share, img, cmd); err != nil {
		os.RemoveAll(share)
		return nil, err
	}
	q, err := startQEMU(img, share, cmd.Network)
	if err != nil {
		os.RemoveAll(share)
		return nil, err
	}
	m := &Machine{cmd: cmd, share: share, q: q, start: time.Now(), booted: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		defer os.RemoveAll(share)
		defer q.stop()
		m.res, m.err = m.wait(ctx)
	}()
	return m, nil
}

// BootTime is the time from Start to the start of the command; 0 before the boot.
func (m *Machine) BootTime() time.Duration {
	select {
	case <-m.booted:
		return m.boot
	default:
		return 0
	}
}

// Share is the host's directory that the guest sees at GuestShareDir, writable from both
// sides while the guest runs (removed once it is gone): a channel for files between the
// caller and a long-running guest command.
func (m *Machine) Share() string { return m.share }

// Done is closed once the guest is gone; Wait then returns at once.
func (m *Machine) Done() <-chan struct{} { return m.done }

// Stop asks the guest command to end: it creates the file that guest.StopRequested looks for
// ($DIRPV_VM_STOP in the guest). The command decides how to end; its deadline still holds.
func (m *Machine) Stop() error {
	select {
	case <-m.done:
		return nil
	default:
	}
	f, err := os.Create(filepath.Join(m.share, stopFile))
	if errors.Is(err, os.ErrNotExist) { // the guest is gone and its share removed
		return nil
	}
	if err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	return f.Close()
}

// Wait waits until the guest command has finished and the guest is gone, and returns the
// command's Result as Run does.
func (m *Machine) Wait() (*Result, error) {
	<-m.done
	return m.res, m.err
}

func (m *Machine) wait(ctx context.Context) (*Result, error) {
	cmd, share, q := m.cmd, m.share, m.q
	res := &Result{}
	defer func() { res.Console, _ = os.ReadFile(q.console) }()
	tail := &tailer{path: filepath.Join(share, "output"), w: cmd.Output}
	booted := false
	deadline := time.NewTimer(cmd.BootTimeout - time.Since(m.start))
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			res.Output = tail.all()
			return res, fmt.Errorf("vm: %w (booted: %t)%s", ctx.Err(), booted, q.consoleTail())
		case <-deadline.C:
			res.Output = tail.all()
			if !booted {
				return res, fmt.Errorf("vm: guest did not boot within %v%s", cmd.BootTimeout, q.consoleTail())
			}
			return res, fmt.Errorf("vm: command %q did not finish within %v", strings.Join(cmd.Args, " "), cmd.Timeout)
		case <-q.exited:
			// A finished command powers the guest off; read what it left below.
		case <-tick.C:
		}
		if _, err := os.Stat(filepath.Join(share, "booted")); !booted && err == nil {
			booted = true
			res.Boot = time.Since(m.start)
			m.boot = res.Boot
			close(m.booted)
			deadline.Reset(cmd.Timeout)
		}
		tail.flush()
		if rc, err := os.ReadFile(filepath.Join(share, "rc")); err == nil {
			res.Run = time.Since(m.start) - res.Boot
			code, err := strconv.Atoi(strings.TrimSpace(string(rc)))
			if err != nil {
				return res, fmt.Errorf("vm: exit status file says %q", rc)
			}
			res.ExitCode = code
			break
		}
		select {
		case <-q.exited:
			res.Output = tail.all()
			return res, fmt.Errorf("vm: qemu exited (%v) before the command finished (booted: %t)%s", q.waitErr, booted, q.consoleTail())
		default:
		}
	}
	select { // the guest's power-off gets up to 30 s before q.stop kills it
	case <-q.exited:
	case <-time.After(30 * time.Second):
	}
	res.Output = tail.all()
	var err error
	res.Files, err = readTree(filepath.Join(share, "results"))
	if err != nil {
		return res, err
	}
	return res, nil
}

func writeStage2(share string, img *Image, cmd Command) error {
	var env strings.Builder
	for _, kv := range cmd.Env {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.ContainsAny(k, " \t\n'\"$;&|") {
			return fmt.Errorf("vm: bad environment entry %q", kv)
		}
		fmt.Fprintf(&env, "export %s\n", shellQuote(kv))
	}
	args := make([]string, len(cmd.Args))
	for i, a := range cmd.Args {
		args[i] = shellQuote(a)
	}
	network := ":"
	if n := cmd.Network; n != nil {
		if n.Tap == "" || n.Address == "" {
			return fmt.Errorf("vm: a network needs a tap device and the guest's address: %+v", *n)
		}
		// virtio_net is loaded here rather than by the initramfs: only networked guests need it.
		network = "modprobe virtio_net && ip link set eth0 up && ip addr add " + shellQuote(n.Address) + " dev eth0"
		if n.Gateway != "" {
			network += " && ip route add default via " + shellQuote(n.Gateway)
		}
	}
	script := fmt.Sprintf(stage2, shellQuote(img.Modules), img.Version, shellQuote(cmd.Dir), env.String(), strings.Join(args, " "), network)
	if err := os.WriteFile(filepath.Join(share, "stage2.sh"), []byte(script), 0o755); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	return nil
}

// shellQuote single-quotes s for sh, ending and reopening the quotes around each quote in s.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

type qemu struct {
	console string
	proc    *os.Process
	exited  chan struct{}
	waitErr error
}

// startQEMU starts qemu as a child of this process, with its own process group (a Ctrl-C of
// the test is handled by our cleanup, not delivered to qemu half-way) and SIGKILL should this
// process die first, so that a crashed test leaves no VM behind.
func startQEMU(img *Image, share string, network *Network) (*qemu, error) {
	q := &qemu{console: filepath.Join(share, "console.log"), exited: make(chan struct{})}
	args := []string{
		"-nodefaults", "-no-user-config", "-no-reboot",
		// KVM does not work on these machines (the notes): TCG only.
		"-accel", "tcg,thread=multi", "-cpu", "max", "-smp", "2", "-m", "2048",
		"-display", "none", "-monitor", "none",
		"-serial", "file:" + q.console,
		"-kernel", img.Kernel, "-initrd", img.Initramfs,
		"-append", "console=ttyS0 quiet panic=-1 rdinit=/init",
		"-virtfs", "local,path=/,mount_tag=" + tagHostRoot + ",security_model=none,readonly=on,multidevs=remap",
		"-virtfs", "local,path=" + share + ",mount_tag=" + tagShare + ",security_model=none,multidevs=remap",
	}
	if network == nil {
		args = append(args, "-nic", "none")
	} else {
		args = append(args, "-netdev", "tap,id=n0,ifname="+network.Tap+",script=no,downscript=no",
			"-device", "virtio-net-pci,netdev=n0")
	}
	cmd := exec.Command("qemu-system-x86_64", args...)
	cmd.Dir = share
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("vm: starting qemu (package qemu-system-x86): %w", err)
	}
	q.proc = cmd.Process
	go func() {
		err := cmd.Wait()
		if err != nil && stderr.Len() > 0 {
			err = fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
		}
		q.waitErr = err
		close(q.exited)
	}()
	return q, nil
}

// stop kills qemu by its PID and waits until it has been reaped.
func (q *qemu) stop() {
	select {
	case <-q.exited:
		return
	default:
	}
	_ = q.proc.Kill()
	<-q.exited
}

// consoleTail is the end of the console log, for errors.
func (q *qemu) consoleTail() string {
	b, _ := os.ReadFile(q.console)
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return "\nguest console (tail):\n" + string(b)
}

// LastLines is the end of b, at most n lines, for failure messages.
func LastLines(b []byte, n int) string {
	lines := bytes.SplitAfter(b, []byte("\n"))
	return string(bytes.Join(lines[max(0, len(lines)-n):], nil))
}

// tailer copies what the guest appends to a file to w as it appears.
type tailer struct {
	path string
	w    io.Writer
	buf  bytes.Buffer
}

func (t *tailer) flush() {
	f, err := os.Open(t.path)
	if err != nil {
		return
	}
	defer f.Close()
	if _, err := f.Seek(int64(t.buf.Len()), io.SeekStart); err != nil {
		return
	}
	n := t.buf.Len()
	_, _ = t.buf.ReadFrom(f)
	if t.w != nil && t.buf.Len() > n {
		_, _ = t.w.Write(t.buf.Bytes()[n:])
	}
}

func (t *tailer) all() []byte {
	t.flush()
	return bytes.Clone(t.buf.Bytes())
}

// readTree reads every regular file below dir, keyed by its path relative to dir.
func readTree(dir string) (map[string][]byte, error) {
	files := map[string][]byte{}
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			if p == dir && errors.Is(err, os.ErrNotExist) {
				return filepath.SkipDir
			}
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		files[rel] = b
		return nil
	})
	if err != nil {
		return files, fmt.Errorf("vm: reading result files: %w", err)
	}
	return files, nil
}
