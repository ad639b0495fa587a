package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/vm/guest"
)

// agentWorkDir is the node's work directory in the guest (containerd's root and state,
// kubelet's config), on a tmpfs of its own: containerd's overlayfs snapshots cannot have
// the guest's root, itself an overlay, as their upper layer.
const agentWorkDir = "/var/lib/dirpv-vm-node"

// agentSlowdown stretches the node's waits: Go binaries start 5-17x slower under the VM's
// emulation than on the host.
const agentSlowdown = 10

// agentMain is the guest's node agent: it readies the guest for a node, starts containerd and
// kubelet with cluster.StartNode, answers the host's requests (serveControl), and stops them
// once the host asks (guest.StopRequested) or a signal comes.
// The node's logs go to the results share (logs/), so the host keeps them.
func agentMain(cfgPath string) int {
	logf := func(format string, args ...any) {
		fmt.Printf(time.Now().Format("15:04:05.000")+" node agent: "+format+"\n", args...)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The host's request to stop ends a node start that hangs as well as a running node.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for !guest.StopRequested() && ctx.Err() == nil {
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
		cancel()
	}()
	var cfg agentConfig
	b, err := os.ReadFile(cfgPath)
	if err == nil {
		err = json.Unmarshal(b, &cfg)
	}
	if err != nil {
		logf("reading the configuration: %v", err)
		return 1
	}
	if err := setupGuest(agentWorkDir); err != nil {
		logf("readying the guest: %v", err)
		return 1
	}
	if cfg.Disks {
		unmount, err := setupDisks(filepath.Join(agentWorkDir, "disks"))
		if err != nil {
			logf("making the disks: %v", err)
			return 1
		}
		defer func() {
			if err := unmount(); err != nil {
				logf("unmounting the disks: %v", err)
			}
		}()
		logf("disks mounted: %v", Disks)
	}
	var srv *guest.NFSServer
	if cfg.NFS {
		if srv, err = startNFS(ctx); err != nil {
			logf("starting the NFS server: %v", err)
			return 1
		}
		defer srv.Close()
		logf("NFS server exports %s", NFSExportDir)
	}
	controlDone := make(chan struct{})
	go func() {
		defer close(controlDone)
		serveControl(ctx, srv, logf)
	}()
	// The NFS server is closed only once no request uses it any more.
	defer func() { cancel(); <-controlDone }()
	start := time.Now()
	c, err := cluster.StartNode(ctx, cluster.NodeOptions{
		WorkDir: agentWorkDir, BinDir: cfg.BinDir, NodeName: cfg.NodeName, Kubeconfig: cfg.Kubeconfig,
		CAFile: cfg.CAFile, NodeIP: cfg.NodeIP, Images: cfg.Images, Slowdown: agentSlowdown, Logf: logf,
	})
	if err != nil {
		logf("starting the node: %v", err)
		return 1
	}
	logf("node %s Ready %s after the agent began to start it", cfg.NodeName, time.Since(start).Round(time.Millisecond))
	<-ctx.Done()
	logf("stopping the node")
	if err := c.Stop(); err != nil {
		logf("stopping the node: %v", err)
		return 1
	}
	return 0
}

// startNFS starts the guest's kernel NFS server exporting NFSExportDir, a tmpfs of its own
// (nfsd exports a tmpfs only with an fsid, which Export gives), root not squashed (the
// controller creates volume directories as root), as the NFSv4 root: NFSv4 clients mount it as
// NFSAddr:/, NFSv3 clients by its path.
func startNFS(ctx context.Context) (*guest.NFSServer, error) {
	if err := os.MkdirAll(NFSExportDir, 0o755); err != nil {
		return nil, err
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", NFSExportDir).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("mount a tmpfs on %s: %w: %s", NFSExportDir, err, strings.TrimSpace(string(out)))
	}
	srv, err := guest.StartNFS(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := srv.Export(ctx, NFSExportDir, guest.NoRootSquash, guest.V4Root); err != nil {
		srv.Close()
		return nil, err
	}
	return srv, nil
}

// guestOwnDirs are kubelet's root (cluster.KubeletRootDir) and the base of deploy/'s local
// class.
var guestOwnDirs = []string{cluster.KubeletRootDir, "/var/lib/dirpv"}

// setupGuest gives the guest what a node needs beyond the VM's boot: the unified cgroup
// hierarchy with every controller delegated (the host runs v1; the guest's kernel does v2),
// shared mount propagation (kubelet and Bidirectional volume mounts), the modules of the CNI
// bridge, and the node's work directory on a tmpfs with its logs directory on the results
// share.
func setupGuest(workDir string) error {
	logs := filepath.Join(guest.ResultsDir(), "logs")
	for _, d := range []string{"/sys/fs/cgroup", workDir, logs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// kubelet's root and dirpv's local base get tmpfs mounts of the guest's own: below them
	// is the host's root, where other tests make and remove the same directories, and a
	// directory that vanishes from the overlay's lower layer fails the guest's mkdir below it
	// with ENOENT (seen: kubelet's "mkdir /var/lib/kubelet/plugins/kubernetes.io/csi").
	for _, d := range guestOwnDirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	steps := [][]string{
		{"mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", guestOwnDirs[0]},
		{"mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", guestOwnDirs[1]},
		{"mount", "-t", "cgroup2", "cgroup2", "/sys/fs/cgroup"},
		{"mount", "--make-rshared", "/"},
		{"modprobe", "-a", "bridge", "veth"},
		{"mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", workDir},
		{"mkdir", "-p", filepath.Join(workDir, "logs")},
		{"mount", "--bind", logs, filepath.Join(workDir, "logs")},
	}
	for _, s := range steps {
		if out, err := exec.Command(s[0], s[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %w: %s", strings.Join(s, " "), err, strings.TrimSpace(string(out)))
		}
	}
	ctrls, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers")
	if err != nil {
		return err
	}
	var enable []string
	for _, c := range strings.Fields(string(ctrls)) {
		enable = append(enable, "+"+c)
	}
	if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte(strings.Join(enable, " ")), 0o644); err != nil {
		return fmt.Errorf("enable cgroup controllers %v: %w", enable, err)
	}
	return nil
}
