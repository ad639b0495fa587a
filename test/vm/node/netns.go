package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/vm"
	"github.com/dirpv/dirpv/test/vm/guest"
)

// The network between the host's control plane and the guest: a tap device in the test
// process's own network namespace. Nothing else is in that namespace, so the addresses are
// the test's alone.
const (
	// HostAddr is the host end of the tap device: kube-apiserver binds and advertises it
	// (cluster.Options.Address).
	HostAddr = "192.168.254.1"
	// GuestAddr is the guest's eth0, the node's InternalIP.
	GuestAddr = "192.168.254.2"
	prefixLen = "/24"
	tapDevice = "dirpvtap0"
)

// netnsEnv, set by Main's parent process, holds the parent's network namespace, which the
// child checks it has left; agentEnv, set in the guest, holds the node agent's configuration.
const (
	netnsEnv = "DIRPV_VM_NODE_PARENT_NETNS"
	agentEnv = "DIRPV_VM_NODE_AGENT"
)

// Main is the TestMain of a package whose tests use a node in the guest; run runs the tests
// (m.Run, or framework.RunSuite). The same test binary is three programs:
//
//   - on the host, first: it installs what the tier needs while the host's network is there
//     (the VM's packages and kernel, the Kubernetes binaries, containerd and runc), then runs
//     itself again in a new network namespace and exits with that run's status, after ending
//     any process left in that namespace;
//   - in that namespace: it makes the tap device the guest attaches to, then runs run;
//   - in the guest (Start boots it with a copy of this binary): the node agent, which starts
//     containerd and kubelet and stops them when the host asks; and, run by the agent for
//     Node.Bench, the bench's guest-side measurements.
func Main(m *testing.M, run func() int) int {
	if guest.InVM() {
		// Before agentEnv: the agent runs the bench with its own environment.
		if req := os.Getenv(benchEnv); req != "" {
			return benchMain(req)
		}
		if cfg := os.Getenv(agentEnv); cfg != "" {
			return agentMain(cfg)
		}
		fmt.Fprintln(os.Stderr, "FAIL: package node's tests run on the host; the guest runs only its node agent")
		return 1
	}
	parent := os.Getenv(netnsEnv)
	if parent == "" {
		return reexecInNetns()
	}
	self, err := netnsID(os.Getpid())
	if err != nil || self == parent {
		fmt.Fprintf(os.Stderr, "FAIL: not in a network namespace of the test's own (namespace %q, parent's %q, %v): run the test binary itself, not with %s set\n", self, parent, err, netnsEnv)
		return 1
	}
	if err := setupNetns(); err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: setting up the test's network namespace: %v\n", err)
		return 1
	}
	return run()
}

// prepare installs and builds, with the host's network, everything the run inside the network
// namespace would otherwise fetch: there it has none.
func prepare(ctx context.Context) error {
	if os.Geteuid() != 0 {
		return errors.New("a node in the VM needs root (qemu, network namespaces, containerd)")
	}
	if _, err := vm.Prepare(ctx, os.Stderr); err != nil {
		return fmt.Errorf("the VM cannot start on this machine: %w", err)
	}
	if _, err := cluster.Build(ctx); err != nil {
		return err
	}
	return cluster.EnsureNodePackages(ctx, func(f string, a ...any) { fmt.Fprintf(os.Stderr, f+"\n", a...) })
}

// reexecInNetns prepares, then runs this binary with the same arguments in a new network
// namespace and returns its exit status. The child dies with this process (Pdeathsig); once
// it has exited, whatever it left running in its namespace (the control plane of a child
// killed by its test deadline) is killed, so that the namespace goes too.
func reexecInNetns() int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	err := prepare(ctx)
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: preparing the VM node: %v\n", err)
		return 1
	}
	self, err := netnsID(os.Getpid())
	if err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: %v\n", err)
		return 1
	}
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), netnsEnv+"="+self)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	// A Ctrl-C reaches the child through the terminal's process group; this process waits
	// for it to clean up rather than die first. (Notify, not Ignore: an ignored signal would
	// stay ignored in the child.)
	signal.Notify(make(chan os.Signal, 1), os.Interrupt, syscall.SIGTERM)
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: running the tests in a new network namespace: %v\n", err)
		return 1
	}
	ns, nsErr := netnsID(cmd.Process.Pid)
	err = cmd.Wait()
	if nsErr == nil && ns != self {
		if pids := killNetns(ns); len(pids) > 0 {
			fmt.Fprintf(os.Stderr, "killed processes left in the test's network namespace: %v\n", pids)
		}
	}
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		if exit.ExitCode() < 0 {
			fmt.Fprintf(os.Stderr, "FAIL: the tests ended with %v\n", err)
			return 1
		}
		return exit.ExitCode()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: %v\n", err)
		return 1
	}
	return 0
}

// netnsID is the network namespace of process pid, as its /proc link reads ("net:[4026...]").
func netnsID(pid int) (string, error) {
	id, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return "", fmt.Errorf("network namespace of pid %d: %w", pid, err)
	}
	return id, nil
}

// killNetns SIGKILLs every process in network namespace ns and returns their PIDs. Only the
// child of reexecInNetns made that namespace, so all of them are its descendants.
func killNetns(ns string) []int {
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if id, err := netnsID(pid); err == nil && id == ns {
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

// setupNetns brings up the namespace's loopback and makes the tap device with the host's
// address; qemu attaches the guest to it (vm.Network).
func setupNetns() error {
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"tuntap", "add", "dev", tapDevice, "mode", "tap"},
		{"addr", "add", HostAddr + prefixLen, "dev", tapDevice},
		{"link", "set", tapDevice, "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}

// inTestNetns reports whether Main has set up this process's network namespace.
func inTestNetns() bool {
	// Not /sys/class/net: sysfs shows the namespace of whoever mounted it.
	_, err := net.InterfaceByName(tapDevice)
	return os.Getenv(netnsEnv) != "" && err == nil
}
