// Package node runs a Kubernetes node inside the test VM of package vm: containerd, runc and
// kubelet on the guest's real kernel (NFS client and server, quotas), joined to a control
// plane of package cluster that runs on the host at native speed, since Go binaries run 5-17x
// slower under the VM's emulation (../../../../shared/notes/real-kernel-vm.md).
//
// Host and guest talk over a tap device in a network namespace that the test process makes
// for itself and that dies with it (Main): the host end is HostAddr, the guest GuestAddr, and
// nothing else is reachable from either.
//
//	func TestMain(m *testing.M) { os.Exit(node.Main(m, m.Run)) }
//
//	c, _ := cluster.Start(ctx, cluster.Options{Address: node.HostAddr})
//	n, _ := node.Start(ctx, node.Options{Cluster: c, Image: img})
//	defer n.Stop()
package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm"
	"github.com/dirpv/dirpv/test/vm/guest"
)

// NFSExportDir is the guest's directory that its NFS server exports (Options.NFS), on a tmpfs
// of its own; NFSAddr is the server's address, the guest's loopback.
const (
	NFSExportDir = "/srv/dirpv-nfs"
	NFSAddr      = guest.NFSAddr
)

// DefaultName is the guest node's name unless Options says otherwise.
const DefaultName = "dirpv-vm-node"

// Options configures Start.
type Options struct {
	// Cluster is the control plane the node joins, started in this process's network
	// namespace with Address HostAddr.
	Cluster *cluster.Cluster
	// Image is the VM (vm.Prepare).
	Image *vm.Image
	// Name is the node's name; default DefaultName.
	Name string
	// Images are image tars the node imports besides pause and busybox (cluster.BusyboxImage).
	Images []string
	// Timeout bounds the guest's whole life, tests included; default 30 minutes.
	Timeout time.Duration
	// NFS starts the guest's kernel NFS server before the node, exporting NFSExportDir to
	// NFSAddr, the guest's loopback: pods on the host network (dirpv's controller and node
	// plugin) reach it there.
	NFS bool
	// Disks mounts the guest's quota-enforcing disks (Disks: XFS and ext4 with project quota)
	// before the node starts.
	Disks bool
	// Output receives the guest's output (the node agent's progress) as it comes.
	Output io.Writer
}

// Node is a running node in the guest.
type Node struct {
	// Name is the node's name.
	Name string
	// Machine is the guest.
	Machine *vm.Machine
	// Boot is the time from Start to the guest's boot, Ready to the node's Ready condition
	// seen through the API.
	Boot, Ready time.Duration
	dir         string
	// cancel ends the guest at once, whatever its agent does.
	cancel context.CancelFunc
}

// agentConfig is what the host hands the node agent in the guest, as JSON in a file of the
// shared directory; every path in it is one the guest sees at the same place.
type agentConfig struct {
	NodeName   string   `json:"nodeName"`
	BinDir     string   `json:"binDir"`
	Kubeconfig string   `json:"kubeconfig"`
	CAFile     string   `json:"caFile"`
	NodeIP     string   `json:"nodeIP"`
	Images     []string `json:"images"`
	NFS        bool     `json:"nfs"`
	Disks      bool     `json:"disks"`
}

// Start boots the guest with its node agent, which starts containerd and kubelet there, and
// returns once the node is Ready in the API. It runs in the network namespace of Main. On
// error, the guest is stopped again.
func Start(ctx context.Context, opts Options) (_ *Node, err error) {
	if !inTestNetns() {
		return nil, errors.New("node: Start runs in the network namespace that Main makes (call node.Main from TestMain)")
	}
	if opts.Cluster == nil || opts.Image == nil {
		return nil, errors.New("node: a control plane and a VM image are needed")
	}
	if opts.Cluster.APIServerHost != HostAddr {
		return nil, fmt.Errorf("node: the control plane listens on %s, not on the tap device's %s (cluster.Options.Address)", opts.Cluster.APIServerHost, HostAddr)
	}
	n := &Node{Name: opts.Name}
	if n.Name == "" {
		n.Name = DefaultName
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 30 * time.Minute
	}
	// The guest sees the host's files, but not the host's /tmp, where the control plane and
	// this test binary usually are: what the guest needs goes to a shared directory.
	if n.dir, err = vm.SharedDir("node-"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(n.dir)
		}
	}()
	cfg := agentConfig{NodeName: n.Name, BinDir: opts.Cluster.BinDir, NodeIP: GuestAddr, NFS: opts.NFS, Disks: opts.Disks,
		Kubeconfig: filepath.Join(n.dir, "kubelet.kubeconfig"), CAFile: filepath.Join(n.dir, "ca.crt")}
	if err := opts.Cluster.NodeKubeconfig(n.Name, cfg.Kubeconfig); err != nil {
		return nil, err
	}
	if err := copyFile(opts.Cluster.CAFile, cfg.CAFile, 0o644); err != nil {
		return nil, err
	}
	if cfg.Images, err = cluster.BuildNodeImages(ctx, filepath.Join(n.dir, "images")); err != nil {
		return nil, err
	}
	for _, img := range opts.Images {
		dst := filepath.Join(n.dir, "images", filepath.Base(img))
		if err := copyFile(img, dst, 0o644); err != nil {
			return nil, err
		}
		cfg.Images = append(cfg.Images, dst)
	}
	// The agent is this very test binary (Main runs it as the agent in the guest).
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	agent := filepath.Join(n.dir, "agent")
	if err := copyFile(self, agent, 0o755); err != nil {
		return nil, err
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	cfgPath := filepath.Join(n.dir, "agent.json")
	if err := os.WriteFile(cfgPath, b, 0o644); err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}

	cs, err := opts.Cluster.Client()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	for attempt := 1; ; attempt++ {
		err = n.boot(ctx, opts, agent, cfgPath, cs)
		if err == nil || !errors.Is(err, errNeverRegistered) || attempt == bootAttempts {
			break
		}
		// Nothing of dirpv runs before the node registers: a guest whose kubelet never
		// reached the API hung under emulation (seen once in ~10 boots: kubelet's log and
		// events stop seconds after it starts, qemu spinning). Boot it afresh, once.
		fmt.Fprintf(opts.Output, "node %s: %v; booting the guest again\n", n.Name, err)
	}
	n.Ready = time.Since(start)
	if err != nil {
		return nil, fmt.Errorf("node %s in the VM: %w", n.Name, err)
	}
	return n, nil
}

// Timeouts of a guest node's start, minutes under emulation on a busy host: registerTimeout
// from the guest's start to the Node object kubelet registers (~30 s idle), readyTimeout to
// its Ready condition.
const (
	registerTimeout = 5 * time.Minute
	readyTimeout    = 10 * time.Minute
	bootAttempts    = 2
)

// errNeverRegistered says that the guest's kubelet never created its Node object.
var errNeverRegistered = errors.New("kubelet in the guest never registered its node")

// boot starts the guest and waits for its node to be Ready. On error the guest is stopped
// and gone, its result (what says why) in the error.
func (n *Node) boot(ctx context.Context, opts Options, agent, cfgPath string, cs kubernetes.Interface) (err error) {
	mctx, cancel := context.WithCancel(ctx)
	n.Machine, err = vm.Start(mctx, opts.Image, vm.Command{
		Args:    []string{agent},
		Env:     []string{agentEnv + "=" + cfgPath},
		Timeout: opts.Timeout,
		Output:  opts.Output,
		Network: &vm.Network{Tap: tapDevice, Address: GuestAddr + prefixLen, Gateway: HostAddr},
	})
	if err != nil {
		cancel()
		return err
	}
	n.cancel = cancel
	defer func() {
		if err == nil {
			return
		}
		// Asked to stop, an agent that still runs ends cleanly; a hung guest is ended by
		// cancelling its context rather than by its own 30-minute deadline.
		_ = n.Machine.Stop()
		select {
		case <-n.Machine.Done():
		case <-time.After(time.Minute):
		}
		cancel()
		if res, _ := n.Machine.Wait(); res != nil {
			err = fmt.Errorf("%w\n%s", err, Diagnose(res))
		}
	}()
	start := time.Now()
	err = framework.Poll(ctx, registerTimeout, func(ctx context.Context) (bool, error) {
		select {
		case <-n.Machine.Done():
			return false, errors.New("the guest is gone")
		default:
		}
		_, err := cs.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		return err == nil, err
	})
	if err != nil {
		if _, getErr := cs.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{}); apierrors.IsNotFound(getErr) {
			return fmt.Errorf("%w within %v of the guest's start: %v", errNeverRegistered, registerTimeout, err)
		}
		return err
	}
	return framework.Poll(ctx, readyTimeout-time.Since(start), func(ctx context.Context) (bool, error) {
		select {
		case <-n.Machine.Done():
			return false, errors.New("the guest is gone")
		default:
		}
		node, err := cs.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				n.Boot = n.Machine.BootTime()
				return true, nil
			}
		}
		return false, fmt.Errorf("node %s is not Ready: %v", n.Name, node.Status.Conditions)
	})
}

// Stop asks the node agent to stop kubelet, the pods and containerd, waits until the guest
// has powered off (its own deadline bounds that) and removes the shared directory. It returns
// the guest's Result (the agent's output, the node's logs in Files under logs/) and an error
// if the agent did not end cleanly.
func (n *Node) Stop() (*vm.Result, error) {
	defer os.RemoveAll(n.dir)
	if err := n.Machine.Stop(); err != nil {
		return nil, err
	}
	res, err := n.Machine.Wait()
	n.cancel()
	if err != nil {
		return res, fmt.Errorf("node %s: %w", n.Name, err)
	}
	if res.ExitCode != 0 {
		return res, fmt.Errorf("node %s: the agent in the guest exited with status %d\n%s", n.Name, res.ExitCode, Diagnose(res))
	}
	return res, nil
}

// Diagnose is what says why a guest node failed: the ends of the agent's output, of kubelet's
// and containerd's logs, and of the guest's console.
func Diagnose(res *vm.Result) string {
	var b strings.Builder
	for _, part := range []struct {
		name string
		text []byte
	}{
		{"node agent output", res.Output},
		{"kubelet log", res.Files["logs/kubelet.log"]},
		{"containerd log", res.Files["logs/containerd.log"]},
		{"guest console", res.Console},
	} {
		fmt.Fprintf(&b, "%s (tail):\n%s\n", part.name, vm.LastLines(part.text, 30))
	}
	return b.String()
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("node: %w", err)
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return fmt.Errorf("node: %w", err)
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return fmt.Errorf("node: %w", err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("node: copy %s: %w", src, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("node: %w", err)
	}
	return nil
}
