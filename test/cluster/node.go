package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/image"
)

const (
	// KubeletRootDir is where the node's kubelet keeps pods, volumes and plugin sockets.
	//
	// It is the stock /var/lib/kubelet rather than a directory under WorkDir because deploy/
	// (the CSI node DaemonSet: hostPath mounts of /var/lib/kubelet/plugins,
	// /var/lib/kubelet/plugins_registry and the pods dir with Bidirectional propagation) must
	// work unchanged in e2e, exactly as a user applies it. kubelet also writes
	// /var/lib/kubelet/device-plugins regardless of --root-dir, so a private root would not
	// keep the host clean anyway. The price: one node cluster per host at a time.
	KubeletRootDir = "/var/lib/kubelet"

	// PauseImage is the sandbox image every node has; Cluster.PauseImage of a cluster with a node.
	PauseImage = "dirpv.local/pause:1"
	// BusyboxImage is the busybox image every node has (BuildNodeImages), for pods with
	// imagePullPolicy Never; Cluster.BusyboxImage of a cluster with a node.
	BusyboxImage = "dirpv.local/busybox:1"
	// ExamplesBusyboxImage is the name examples/ give busybox, as users write it ("busybox:1.36"
	// normalised). Every node has BusyboxImage under this name too, so that those manifests
	// run unchanged, with their default imagePullPolicy (IfNotPresent), on a cluster that
	// reaches no registry.
	ExamplesBusyboxImage = "docker.io/library/busybox:1.36"
	// bridgeName is the CNI bridge; a dirpv-specific name so teardown never deletes a bridge
	// that belongs to something else (cni0, docker0).
	bridgeName = "dirpv0"
	podSubnet  = "10.88.0.0/16"
	cniBinDir  = "/usr/lib/cni" // Debian containernetworking-plugins
)

// aptPackages maps a required file to the Debian package that provides it.
var aptPackages = []struct{ file, pkg string }{
	{"/usr/bin/containerd", "containerd"},
	{"/usr/bin/ctr", "containerd"},
	{"/usr/sbin/runc", "runc"},
	{cniBinDir + "/bridge", "containernetworking-plugins"},
	{cniBinDir + "/host-local", "containernetworking-plugins"},
	{cniBinDir + "/loopback", "containernetworking-plugins"},
	{"/bin/busybox", "busybox-static"},
}

// EnsureNodePackages installs the Debian packages a node needs (containerd, runc, the CNI
// plugins, busybox-static for the busybox image) when their files are missing, so a fresh CI
// machine works without a setup step. A node in a VM that runs the host's binaries needs them
// installed on the host before it boots.
func EnsureNodePackages(ctx context.Context, logf func(string, ...any)) error {
	var missing []string
	seen := map[string]bool{}
	for _, p := range aptPackages {
		if _, err := os.Stat(p.file); err != nil && !seen[p.pkg] {
			seen[p.pkg] = true
			missing = append(missing, p.pkg)
		}
	}
	// /bin/busybox may be the dynamically linked Debian "busybox", useless in an image.
	if !seen["busybox-static"] {
		if out, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f=${Status}", "busybox-static").Output(); err != nil || !strings.Contains(string(out), "ok installed") {
			missing = append(missing, "busybox-static")
		}
	}
	if len(missing) == 0 {
		return nil
	}
	if logf == nil {
		logf = klog.Infof
	}
	logf("installing Debian packages %v", missing)
	env := append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	for _, args := range [][]string{{"update"}, append([]string{"install", "-y", "--no-install-recommends"}, missing...)} {
		cmd := exec.CommandContext(ctx, "apt-get", args...)
		cmd.Env = env
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("apt-get %s: %w\n%s", args[0], err, tail(string(out), 20))
		}
	}
	return nil
}

// BuildNodeImages writes the images every node imports into dir: the pause image its
// containerd uses as sandbox image and busybox (Cluster.BusyboxImage), as OCI tars.
func BuildNodeImages(ctx context.Context, dir string) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create image dir: %w", err)
	}
	pauseTar, busyboxTar := filepath.Join(dir, "pause.tar"), filepath.Join(dir, "busybox.tar")
	if err := buildPauseImage(ctx, filepath.Join(dir, "bin"), pauseTar); err != nil {
		return nil, err
	}
	if err := buildBusyboxImage(ctx, dir, busyboxTar); err != nil {
		return nil, err
	}
	return []string{pauseTar, busyboxTar}, nil
}

// NodeOptions configures StartNode.
type NodeOptions struct {
	// WorkDir holds containerd's root and state, kubelet's config and the logs
	// (WorkDir/logs/<component>.log); it must exist. Stop leaves it in place.
	WorkDir string
	// BinDir holds kubelet.
	BinDir string
	// NodeName is the kubelet's node name, the one Kubeconfig's credentials are for.
	NodeName string
	// Kubeconfig holds the node's credentials and the API server's address (written by the
	// control plane's NodeKubeconfig).
	Kubeconfig string
	// CAFile is the cluster CA (the control plane's CAFile): kubelet accepts the API server's
	// calls (logs, exec) by the client certificates it signed.
	CAFile string
	// NodeIP is the address kubelet registers as the node's InternalIP, where the API
	// server reaches it.
	NodeIP string
	// Images are image tars imported into containerd before kubelet starts; they must hold
	// BuildNodeImages' images.
	Images []string
	// Slowdown multiplies the waits for containerd, the imports, kubelet and Ready: a node
	// under emulation (a VM without KVM) starts several times slower. 0 means 1.
	Slowdown int
	// Logf receives progress messages; default klog.Infof.
	Logf func(format string, args ...any)
}

// StartNode starts containerd and a kubelet on this host that join a control plane running
// elsewhere (Start without WithNode, on another kernel), as a node of its own. Stop stops
// them and reverts the host as for a cluster started WithNode. On error everything started
// so far is stopped again.
func StartNode(ctx context.Context, opts NodeOptions) (_ *Cluster, err error) {
	c := &Cluster{logf: opts.Logf, WorkDir: opts.WorkDir, BinDir: opts.BinDir, CAFile: opts.CAFile,
		NodeName: opts.NodeName, slowdown: opts.Slowdown}
	if c.logf == nil {
		c.logf = klog.Infof
	}
	if opts.WorkDir == "" || opts.NodeName == "" || opts.Kubeconfig == "" || opts.CAFile == "" || opts.NodeIP == "" {
		return nil, fmt.Errorf("start node: work dir, node name, kubeconfig, CA file and node IP are all needed: %+v", opts)
	}
	defer func() {
		if err != nil {
			if stopErr := c.Stop(); stopErr != nil {
				c.logf("cleanup after failed node start: %v", stopErr)
			}
		}
	}()
	if err := os.MkdirAll(filepath.Join(c.WorkDir, "logs"), 0o755); err != nil {
		return nil, fmt.Errorf("create log dir: %w", err)
	}
	if err := c.prepareNode(ctx); err != nil {
		return nil, err
	}
	return c, c.runNode(ctx, opts.Kubeconfig, opts.Images, opts.NodeIP)
}

// prepareNode checks for root, takes the node lock and installs the node's packages.
func (c *Cluster) prepareNode(ctx context.Context) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("a node needs root (containerd, kubelet, mounts, cgroups)")
	}
	if err := c.lockNode(ctx); err != nil {
		return err
	}
	return EnsureNodePackages(ctx, c.logf)
}

func (c *Cluster) startNode(ctx context.Context, opts Options) error {
	if err := c.prepareNode(ctx); err != nil {
		return err
	}
	c.NodeName = opts.NodeName
	if c.NodeName == "" {
		c.NodeName = defaultNodeName
	}
	images, err := BuildNodeImages(ctx, filepath.Join(c.WorkDir, "images"))
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(c.WorkDir, "kubelet.kubeconfig")
	if err := c.NodeKubeconfig(c.NodeName, kubeconfig); err != nil {
		return err
	}
	return c.runNode(ctx, kubeconfig, images, "")
}

// waitFor is a node wait of d, stretched by NodeOptions.Slowdown.
func (c *Cluster) waitFor(d time.Duration) time.Duration {
	return d * time.Duration(max(1, c.slowdown))
}

// runNode starts containerd, imports images and starts kubelet with the credentials in
// kubeconfig, registering nodeIP ("": kubelet's choice) as its address.
func (c *Cluster) runNode(ctx context.Context, kubeconfig string, images []string, nodeIP string) error {
	c.KubeletRootDir = KubeletRootDir
	c.PluginRegistryDir = filepath.Join(KubeletRootDir, "plugins_registry")
	c.PauseImage, c.BusyboxImage = PauseImage, BusyboxImage

	ctrDir := filepath.Join(c.WorkDir, "containerd")
	c.ContainerdSocket = filepath.Join(ctrDir, "containerd.sock")
	// Record the host before touching it, so Stop reverts only what we caused.
	h, err := snapshotHost(c.ContainerdSocket)
	if err != nil {
		return err
	}
	c.Host = h
	if err := h.shareRoot(); err != nil {
		return err
	}

	if err := c.writeContainerdConfig(ctrDir); err != nil {
		return err
	}
	ctrd, err := c.start(filepath.Join(c.WorkDir, "logs"), "containerd", "containerd",
		[]string{"--config", filepath.Join(ctrDir, "config.toml")})
	if err != nil {
		return err
	}
	err = poll(ctx, c.waitFor(30*time.Second), 100*time.Millisecond, "containerd serving", ctrd, func(ctx context.Context) (bool, error) {
		out, err := exec.CommandContext(ctx, "ctr", "--address", c.ContainerdSocket, "version").CombinedOutput()
		if err != nil {
			return false, fmt.Errorf("ctr version: %v: %s", err, strings.TrimSpace(string(out)))
		}
		return true, nil
	})
	if err != nil {
		return err
	}
	for _, tar := range images {
		if err := c.ImportImage(ctx, tar); err != nil {
			return err
		}
	}
	if err := c.TagImage(ctx, BusyboxImage, ExamplesBusyboxImage); err != nil {
		return err
	}
	return c.startKubelet(ctx, kubeconfig, nodeIP)
}

// ImportImage imports an OCI or Docker image tar into the node's containerd, in the k8s.io
// namespace that the CRI plugin serves, so pods can use it with imagePullPolicy: Never.
func (c *Cluster) ImportImage(ctx context.Context, tarPath string) error {
	out, err := c.ctr(ctx, c.waitFor(2*time.Minute), "images", "import", tarPath)
	if err == nil {
		c.logf("imported %s: %s", filepath.Base(tarPath), strings.TrimSpace(out))
	}
	return err
}

// TagImage gives an image already in the node's containerd another name, for suites whose
// pods name images their own way (Kubernetes' e2e suite: registry and version in the name).
func (c *Cluster) TagImage(ctx context.Context, src, dst string) error {
	_, err := c.ctr(ctx, 30*time.Second, "images", "tag", "--force", src, dst)
	return err
}

// ctr runs ctr against the node's containerd in the k8s.io namespace, within timeout.
func (c *Cluster) ctr(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	if c.ContainerdSocket == "" {
		return "", fmt.Errorf("ctr %s: cluster has no node", strings.Join(args, " "))
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ctr", append([]string{"--address", c.ContainerdSocket, "-n", "k8s.io"}, args...)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// ContainerPID returns the host PID of a running container's main process, as the node's
// containerd knows it. containerID is the ID in a pod's container status, with or without its
// containerd:// prefix.
func (c *Cluster) ContainerPID(ctx context.Context, containerID string) (int, error) {
	id := strings.TrimPrefix(containerID, "containerd://")
	out, err := c.ctr(ctx, 30*time.Second, "tasks", "ls")
	if err != nil {
		return 0, err
	}
	// TASK PID STATUS, after a header line.
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != id {
			continue
		}
		if f[2] != "RUNNING" {
			return 0, fmt.Errorf("container %s is %s", id, f[2])
		}
		pid, err := strconv.Atoi(f[1])
		if err != nil {
			return 0, fmt.Errorf("PID of container %s: %w", id, err)
		}
		return pid, nil
	}
	return 0, fmt.Errorf("container %s is not among containerd's tasks:\n%s", id, out)
}

func (c *Cluster) writeContainerdConfig(dir string) error {
	for _, d := range []string{dir, filepath.Join(c.WorkDir, "cni", "net.d")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("create %s: %w", d, err)
		}
	}
	cfg := fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %[3]q

[ttrpc]
  address = "%[3]s.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = %[4]q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[5]q
  # Required here: the sandbox lacks CAP_SYS_RESOURCE, so runc cannot lower oom_score_adj and
  # every sandbox would fail with "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = %[6]q
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[7]q
    conf_dir = %[8]q
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), c.ContainerdSocket,
		filepath.Join(dir, "opt"), PauseImage, filepath.Join(dir, "runc"), cniBinDir,
		filepath.Join(c.WorkDir, "cni", "net.d"))
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(cfg), 0o644); err != nil {
		return fmt.Errorf("write containerd config: %w", err)
	}
	// host-local keeps its leases under WorkDir (dataDir) instead of /var/lib/cni/networks.
	cni := fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "dirpv",
  "plugins": [
    {
      "type": "bridge",
      "bridge": %q,
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": %q}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": %q
      }
    }
  ]
}
`, bridgeName, podSubnet, filepath.Join(c.WorkDir, "cni", "ipam"))
	if err := os.WriteFile(filepath.Join(c.WorkDir, "cni", "net.d", "10-dirpv.conflist"), []byte(cni), 0o644); err != nil {
		return fmt.Errorf("write CNI config: %w", err)
	}
	return nil
}

// nodeLockPath serialises node clusters on a host: they share /var/lib/kubelet, /run/containerd,
// the kubepods cgroups and the bridge. The lock is an flock; kubelet inherits the descriptor, so
// a cluster started by the CLI keeps holding it after the CLI exits, until kubelet stops.
const nodeLockPath = "/run/dirpv-node.lock"

func (c *Cluster) lockNode(ctx context.Context) error {
	f, err := os.OpenFile(nodeLockPath, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("open %s: %w", nodeLockPath, err)
	}
	err = poll(ctx, 10*time.Minute, 500*time.Millisecond, "lock "+nodeLockPath+" (another node cluster is running; `dirpv-cluster down` stops a CLI one)", nil,
		func(context.Context) (bool, error) {
			err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
			return err == nil, err
		})
	if err != nil {
		f.Close()
		return err
	}
	c.nodeLock = f
	return nil
}

// NodeKubeconfig writes to path a kubeconfig with the credentials of node name: a client
// certificate for system:node:<name> in system:nodes, the identity by which the Node
// authorizer and NodeRestriction know a kubelet.
func (c *Cluster) NodeKubeconfig(name, path string) error {
	p := c.pki()
	if err := p.load(); err != nil {
		return err
	}
	cert := "kubelet-" + name
	if err := p.leaf(cert, "system:node:"+name, []string{"system:nodes"}, nil, nil, false, true); err != nil {
		return err
	}
	return p.kubeconfig(path, c.APIServerURL, cert)
}

func (c *Cluster) startKubelet(ctx context.Context, kubeconfig, nodeIP string) error {
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	port, healthzPort := ports[0], ports[1]
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# The hosts here run cgroup v1 (a VM's guest: v2) with cgroupfs and have no systemd as init.
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
# Leave the host's iptables alone; nothing here needs kubelet's chains.
makeIPTablesUtilChains: false
port: %d
healthzBindAddress: 127.0.0.1
healthzPort: %d
readOnlyPort: 0
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: %q
authorization:
  mode: AlwaysAllow
containerRuntimeEndpoint: unix://%s
imageServiceEndpoint: unix://%s
resolvConf: /etc/resolv.conf
# Locally imported images cannot be pulled again: never garbage-collect them, and do not let a
# busy developer disk put the node under pressure and evict test pods.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 50Mi
  nodefs.available: 1%%
  nodefs.inodesFree: 1%%
  imagefs.available: 1%%
serializeImagePulls: false
# Tests wait on pod status; report it promptly.
nodeStatusUpdateFrequency: 4s
# Tests read volumes' usage from kubelet's stats (NodeGetVolumeStats); it refreshes them every
# 1-2 periods, 1m by default.
volumeStatsAggPeriod: 10s
syncFrequency: 10s
`, port, healthzPort, c.CAFile, c.ContainerdSocket, c.ContainerdSocket)
	cfgPath := filepath.Join(c.WorkDir, "kubelet-config.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return fmt.Errorf("write kubelet config: %w", err)
	}
	args := []string{
		"--config=" + cfgPath,
		"--kubeconfig=" + kubeconfig,
		"--root-dir=" + c.KubeletRootDir,
		"--cert-dir=" + filepath.Join(c.WorkDir, "kubelet-pki"),
		"--hostname-override=" + c.NodeName,
		"--v=1",
	}
	if nodeIP != "" {
		args = append(args, "--node-ip="+nodeIP)
	}
	kubelet, err := c.start(filepath.Join(c.WorkDir, "logs"), "kubelet", c.binPath("kubelet"), args, c.nodeLock)
	if err != nil {
		return err
	}
	if err := poll(ctx, c.waitFor(60*time.Second), 200*time.Millisecond, "kubelet /healthz", kubelet,
		httpOK(plainHTTP, fmt.Sprintf("http://127.0.0.1:%d/healthz", healthzPort))); err != nil {
		return err
	}
	// The node's own credentials: they may read its Node, and they are all a node elsewhere
	// (StartNode) has.
	restCfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("load kubeconfig %s: %w", kubeconfig, err)
	}
	cs, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("clientset: %w", err)
	}
	return poll(ctx, c.waitFor(90*time.Second), 250*time.Millisecond, "node "+c.NodeName+" Ready", kubelet, func(ctx context.Context) (bool, error) {
		n, err := cs.CoreV1().Nodes().Get(ctx, c.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return nodeReady(n), nil
	})
}

func (c *Cluster) binPath(name string) string { return filepath.Join(c.BinDir, name) }

// sourceDir is the directory of this package's source, used to find build.sh and pause/.
func sourceDir() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if ok {
		if _, err := os.Stat(filepath.Join(filepath.Dir(file), "build.sh")); err == nil {
			return filepath.Dir(file), nil
		}
	}
	// Binaries built with -trimpath lose the absolute path; fall back to the repo root.
	out, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err == nil {
		dir := filepath.Join(strings.TrimSpace(string(out)), "test", "cluster")
		if _, err := os.Stat(filepath.Join(dir, "build.sh")); err == nil {
			return dir, nil
		}
	}
	return "", fmt.Errorf("cannot find test/cluster sources (build.sh); run from the dirpv checkout")
}

func buildPauseImage(ctx context.Context, binDir, tarPath string) error {
	src, err := sourceDir()
	if err != nil {
		return err
	}
	bin := filepath.Join(binDir, "pause")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./pause")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build pause: %w: %s", err, out)
	}
	return image.WriteOCITar(tarPath, PauseImage, []image.File{{HostPath: bin, ImagePath: "/pause", Mode: 0o755}},
		image.Config{Entrypoint: []string{"/pause"}})
}

func buildBusyboxImage(ctx context.Context, tmpDir, tarPath string) error {
	files, err := image.BusyboxFiles(ctx, tmpDir)
	if err != nil {
		return err
	}
	return image.WriteOCITar(tarPath, BusyboxImage, files, image.Config{Cmd: []string{"sh"}})
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
