// Package cluster builds and runs a real local Kubernetes for dirpv's integration and end-to-end
// tests: etcd, kube-apiserver, kube-controller-manager and kube-scheduler as child processes on
// loopback, and optionally a node made of containerd + runc + kubelet on this host.
//
// Everything listens on 127.0.0.1 with free ports and keeps its files under Options.WorkDir.
// The node part cannot be fully contained (kubelet, libcni and containerd use fixed host paths,
// see hostChanges); Stop undoes exactly what Start created. Only one cluster with a node can run
// on a host at a time.
package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	"crypto/tls"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// Options configures Start.
type Options struct {
	// WorkDir holds certificates, data, logs (WorkDir/logs/<component>.log) and sockets. A
	// temporary directory is created (and removed by Stop) when empty. Keep it short: unix
	// socket paths inside it must stay under 108 bytes.
	WorkDir string
	// BinDir holds etcd and the Kubernetes binaries; Build() is called when empty.
	BinDir string
	// WithNode also starts containerd and a kubelet so that pods really run (needs root).
	WithNode bool
	// NodeName is the kubelet's node name. Default "dirpv-node".
	NodeName string
	// ControllerManagerArgs are appended to kube-controller-manager's flags, e.g.
	// "--kube-api-qps=200", "--kube-api-burst=400".
	ControllerManagerArgs []string
	// APIServerArgs are appended to kube-apiserver's flags.
	APIServerArgs []string
	// Address is the IP address kube-apiserver binds and advertises, and that its certificate
	// and URL name; default 127.0.0.1. A node on another kernel (StartNode in a VM) needs one
	// it can reach: an address of a network namespace the test made.
	Address string
	// Logf receives progress messages; default klog.Infof.
	Logf func(format string, args ...any)
}

// Cluster is a running cluster. Its exported fields are also its state file (see SaveState), so
// a cluster started by one process can be stopped by another.
type Cluster struct {
	WorkDir       string `json:"workDir"`
	Kubeconfig    string `json:"kubeconfig"`
	APIServerURL  string `json:"apiServerURL"`
	APIServerHost string `json:"apiServerHost"`
	APIServerPort int    `json:"apiServerPort"`
	// CAFile is the cluster CA; it signed every serving and client certificate here.
	CAFile string `json:"caFile"`
	BinDir string `json:"binDir"`

	// Node fields are empty without Options.WithNode.
	NodeName          string `json:"nodeName,omitempty"`
	KubeletRootDir    string `json:"kubeletRootDir,omitempty"`
	PluginRegistryDir string `json:"pluginRegistryDir,omitempty"`
	ContainerdSocket  string `json:"containerdSocket,omitempty"`
	BusyboxImage      string `json:"busyboxImage,omitempty"`
	PauseImage        string `json:"pauseImage,omitempty"`

	Procs         []*Proc      `json:"procs"`
	Host          *hostChanges `json:"host,omitempty"`
	RemoveWorkDir bool         `json:"removeWorkDir"`

	logf      func(string, ...any)
	mu        sync.Mutex
	client    kubernetes.Interface
	stopBeats []context.CancelFunc
	nodeLock  *os.File
	// kcmArgs are kube-controller-manager's flags but its serving port (kcmPort) and
	// Options' ControllerManagerArgs, for RestartControllerManager.
	kcmArgs []string
	kcmPort int
	beatsWG sync.WaitGroup
	// slowdown stretches the node's waits (NodeOptions.Slowdown).
	slowdown int
}

const (
	defaultNodeName = "dirpv-node"
	serviceCIDR     = "10.0.0.0/24"
)

// Start starts a control plane, and a node with Options.WithNode. On error everything started
// so far is stopped again.
func Start(ctx context.Context, opts Options) (_ *Cluster, err error) {
	t0 := time.Now()
	c := &Cluster{logf: opts.Logf}
	if c.logf == nil {
		c.logf = klog.Infof
	}
	if opts.WorkDir == "" {
		dir, err := os.MkdirTemp("", "dirpv-cluster-")
		if err != nil {
			return nil, fmt.Errorf("create work dir: %w", err)
		}
		opts.WorkDir, c.RemoveWorkDir = dir, true
	}
	c.WorkDir, err = filepath.Abs(opts.WorkDir)
	if err != nil {
		return nil, fmt.Errorf("work dir: %w", err)
	}
	defer func() {
		if err != nil {
			if stopErr := c.Stop(); stopErr != nil {
				c.logf("cleanup after failed start: %v", stopErr)
			}
		}
	}()
	if err := os.MkdirAll(filepath.Join(c.WorkDir, "logs"), 0o755); err != nil {
		return nil, fmt.Errorf("create log dir: %w", err)
	}
	if opts.BinDir == "" {
		if opts.BinDir, err = Build(ctx); err != nil {
			return nil, err
		}
	}
	c.BinDir = opts.BinDir
	if err := c.startControlPlane(ctx, opts); err != nil {
		return nil, err
	}
	c.logf("control plane ready in %s (kubeconfig %s)", time.Since(t0).Round(time.Millisecond), c.Kubeconfig)
	if opts.WithNode {
		if err := c.startNode(ctx, opts); err != nil {
			return nil, err
		}
		c.logf("node %s ready after %s", c.NodeName, time.Since(t0).Round(time.Millisecond))
	}
	return c, nil
}

func (c *Cluster) pki() *pki { return &pki{dir: filepath.Join(c.WorkDir, "pki")} }

func (c *Cluster) startControlPlane(ctx context.Context, opts Options) error {
	p, err := newPKI(filepath.Join(c.WorkDir, "pki"))
	if err != nil {
		return err
	}
	c.CAFile = p.path("ca.crt")
	ports, err := freePorts(5)
	if err != nil {
		return err
	}
	etcdPort, peerPort, apiPort, kcmPort, schedPort := ports[0], ports[1], ports[2], ports[3], ports[4]
	addr := opts.Address
	if addr == "" {
		addr = "127.0.0.1"
	}
	ip := net.ParseIP(addr)
	if ip == nil {
		return fmt.Errorf("address %q is not an IP address", addr)
	}
	c.APIServerHost, c.APIServerPort = addr, apiPort
	c.APIServerURL = "https://" + net.JoinHostPort(addr, strconv.Itoa(apiPort))

	apiIPs := []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.0.0.1")} // 10.0.0.1: first IP of serviceCIDR, the kubernetes Service
	if !ip.IsLoopback() {
		apiIPs = append(apiIPs, ip)
	}
	steps := []error{
		p.serviceAccountKey(),
		p.leaf("apiserver", "kube-apiserver", nil,
			[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
			apiIPs, true, false),
		p.leaf("admin", "dirpv-admin", []string{"system:masters"}, nil, nil, false, true),
		p.leaf("apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil, nil, false, true),
		p.leaf("controller-manager", "system:kube-controller-manager", nil, nil, nil, false, true),
		p.leaf("scheduler", "system:kube-scheduler", nil, nil, nil, false, true),
	}
	for _, err := range steps {
		if err != nil {
			return err
		}
	}
	c.Kubeconfig = filepath.Join(c.WorkDir, "admin.kubeconfig")
	for name, file := range map[string]string{"admin": c.Kubeconfig,
		"controller-manager": filepath.Join(c.WorkDir, "controller-manager.kubeconfig"),
		"scheduler":          filepath.Join(c.WorkDir, "scheduler.kubeconfig")} {
		if err := p.kubeconfig(file, c.APIServerURL, name); err != nil {
			return err
		}
	}

	bin := c.binPath
	logDir := filepath.Join(c.WorkDir, "logs")

	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	etcd, err := c.start(logDir, "etcd", bin("etcd"), []string{
		"--name=dirpv", "--data-dir=" + filepath.Join(c.WorkDir, "etcd"),
		"--listen-client-urls=" + etcdURL, "--advertise-client-urls=" + etcdURL,
		"--listen-peer-urls=" + peerURL, "--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=dirpv=" + peerURL,
		// Tests do not need durability; fsync dominates etcd latency on small VMs.
		"--unsafe-no-fsync=true", "--log-level=warn",
	})
	if err != nil {
		return err
	}
	if err := poll(ctx, 30*time.Second, 100*time.Millisecond, "etcd healthy", etcd, httpOK(plainHTTP, etcdURL+"/health")); err != nil {
		return err
	}

	apiArgs := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + addr, "--advertise-address=" + addr, "--secure-port=" + strconv.Itoa(apiPort),
		// The default reconciler refuses to advertise a loopback address; with another one the
		// kubernetes Service would still lead nowhere without kube-proxy.
		"--endpoint-reconciler-type=none",
		"--tls-cert-file=" + p.path("apiserver.crt"), "--tls-private-key-file=" + p.path("apiserver.key"),
		"--client-ca-file=" + p.path("ca.crt"),
		"--service-account-key-file=" + p.path("sa.pub"),
		"--service-account-signing-key-file=" + p.path("sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-cluster-ip-range=" + serviceCIDR,
		"--authorization-mode=Node,RBAC",
		// The CSI node plugin DaemonSet needs privileged containers.
		"--allow-privileged=true",
		"--kubelet-client-certificate=" + p.path("apiserver-kubelet-client.crt"),
		"--kubelet-client-key=" + p.path("apiserver-kubelet-client.key"),
		// kubelet reports the host's primary address as InternalIP (it refuses loopback); dial
		// that rather than the node name, which need not resolve.
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		"--profiling=false",
	}
	apiserver, err := c.start(logDir, "kube-apiserver", bin("kube-apiserver"), append(apiArgs, opts.APIServerArgs...))
	if err != nil {
		return err
	}
	cs, err := c.Client()
	if err != nil {
		return err
	}
	err = poll(ctx, 60*time.Second, 200*time.Millisecond, "kube-apiserver /readyz", apiserver, func(ctx context.Context) (bool, error) {
		_, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		return err == nil, err
	})
	if err != nil {
		return err
	}
	c.logf("kube-apiserver ready at %s", c.APIServerURL)

	kcmKubeconfig := filepath.Join(c.WorkDir, "controller-manager.kubeconfig")
	kcmArgs := []string{
		"--kubeconfig=" + kcmKubeconfig,
		"--authentication-kubeconfig=" + kcmKubeconfig, "--authorization-kubeconfig=" + kcmKubeconfig,
		"--bind-address=127.0.0.1",
		"--cert-dir=" + filepath.Join(c.WorkDir, "kcm-serving"),
		"--leader-elect=false",
		"--use-service-account-credentials=true",
		"--root-ca-file=" + p.path("ca.crt"),
		"--service-account-private-key-file=" + p.path("sa.key"),
		"--cluster-signing-cert-file=" + p.path("ca.crt"), "--cluster-signing-key-file=" + p.path("ca.key"),
		"--service-cluster-ip-range=" + serviceCIDR,
	}
	c.kcmArgs, c.kcmPort = kcmArgs, kcmPort
	kcm, err := c.start(logDir, "kube-controller-manager", bin("kube-controller-manager"),
		append(append(slices.Clone(kcmArgs), "--secure-port="+strconv.Itoa(kcmPort)), opts.ControllerManagerArgs...))
	if err != nil {
		return err
	}
	schedKubeconfig := filepath.Join(c.WorkDir, "scheduler.kubeconfig")
	sched, err := c.start(logDir, "kube-scheduler", bin("kube-scheduler"), []string{
		"--kubeconfig=" + schedKubeconfig,
		"--authentication-kubeconfig=" + schedKubeconfig, "--authorization-kubeconfig=" + schedKubeconfig,
		"--bind-address=127.0.0.1", "--secure-port=" + strconv.Itoa(schedPort),
		"--leader-elect=false",
	})
	if err != nil {
		return err
	}
	if err := poll(ctx, 60*time.Second, 200*time.Millisecond, "kube-controller-manager /healthz", kcm,
		httpOK(insecureHTTPS, fmt.Sprintf("https://127.0.0.1:%d/healthz", kcmPort))); err != nil {
		return err
	}
	if err := poll(ctx, 60*time.Second, 200*time.Millisecond, "kube-scheduler /healthz", sched,
		httpOK(insecureHTTPS, fmt.Sprintf("https://127.0.0.1:%d/healthz", schedPort))); err != nil {
		return err
	}
	// Pods are rejected until the service-account controller (KCM) created the default SA.
	return poll(ctx, 60*time.Second, 200*time.Millisecond, "ServiceAccount default/default", kcm, func(ctx context.Context) (bool, error) {
		_, err := cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return err == nil, err
	})
}

// RestartControllerManager stops kube-controller-manager and starts it again with args in
// place of Options.ControllerManagerArgs (e.g. none: its stock client limits), so that one
// cluster can measure both; it returns once the new one is healthy.
func (c *Cluster) RestartControllerManager(ctx context.Context, args []string) error {
	c.mu.Lock()
	i := slices.IndexFunc(c.Procs, func(p *Proc) bool { return p.Name == "kube-controller-manager" })
	c.mu.Unlock()
	if i < 0 || c.kcmArgs == nil {
		return errors.New("restart kube-controller-manager: not started by this process")
	}
	if err := c.Procs[i].stop(15 * time.Second); err != nil {
		return fmt.Errorf("restart kube-controller-manager: %w", err)
	}
	// A new port: the old one, just freed, may already be some connection's local port.
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	p, err := startProc(filepath.Join(c.WorkDir, "logs"), c.WorkDir, "kube-controller-manager", c.binPath("kube-controller-manager"),
		append(append(slices.Clone(c.kcmArgs), "--secure-port="+strconv.Itoa(ports[0])), args...), nil, nil)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.Procs[i], c.kcmPort = p, ports[0]
	c.mu.Unlock()
	return poll(ctx, 60*time.Second, 200*time.Millisecond, "kube-controller-manager /healthz", p,
		httpOK(insecureHTTPS, fmt.Sprintf("https://127.0.0.1:%d/healthz", c.kcmPort)))
}

// start starts a component and records it so Stop finds it even if Start fails later.
func (c *Cluster) start(logDir, name, bin string, args []string, extra ...*os.File) (*Proc, error) {
	p, err := startProc(logDir, c.WorkDir, name, bin, args, nil, extra)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.Procs = append(c.Procs, p)
	c.mu.Unlock()
	c.logf("started %s (pid %d, log %s)", name, p.PID, p.Log)
	return p, nil
}

// Client returns a clientset for the admin kubeconfig (system:masters).
func (c *Cluster) Client() (kubernetes.Interface, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.client != nil {
		return c.client, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", c.Kubeconfig, err)
	}
	// Tests create objects in bursts; client-side throttling would only add noise.
	cfg.QPS, cfg.Burst = 200, 400
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("clientset: %w", err)
	}
	c.client = cs
	return cs, nil
}

// Stop stops all processes (SIGTERM, then SIGKILL after a deadline), unmounts what the node
// left mounted, reverts host changes made by Start and removes a temporary WorkDir. It is safe
// to call more than once and on a partially started cluster.
func (c *Cluster) Stop() error {
	if c.logf == nil {
		c.logf = klog.Infof
	}
	t0 := time.Now()
	c.mu.Lock()
	for _, cancel := range c.stopBeats {
		cancel()
	}
	c.stopBeats = nil
	procs := append([]*Proc(nil), c.Procs...)
	c.mu.Unlock()
	c.beatsWG.Wait()

	var errs []error
	// Reverse start order: kubelet before containerd (so it does not restart pods), the
	// control plane last, etcd at the very end.
	for i := len(procs) - 1; i >= 0; i-- {
		p := procs[i]
		if p.Name == "containerd" {
			// Pod processes and shims are not containerd's children in the process sense;
			// kill them first so nothing keeps mounts or the bridge busy.
			errs = append(errs, c.killPods()...)
		}
		if err := p.stop(15 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	if c.Host != nil {
		errs = append(errs, c.Host.revert(c)...)
	}
	if c.WorkDir != "" {
		if err := unmountUnder(c.WorkDir); err != nil {
			errs = append(errs, err)
		} else if c.RemoveWorkDir {
			if err := os.RemoveAll(c.WorkDir); err != nil {
				errs = append(errs, fmt.Errorf("remove work dir: %w", err))
			}
		}
	}
	c.mu.Lock()
	c.Procs = nil
	c.Host = nil
	if c.nodeLock != nil {
		c.nodeLock.Close()
		c.nodeLock = nil
	}
	c.mu.Unlock()
	c.logf("cluster stopped in %s", time.Since(t0).Round(time.Millisecond))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("stop: %w", err)
	}
	return nil
}

// SaveState writes the cluster's state (PIDs, paths, host changes) as JSON.
func (c *Cluster) SaveState(path string) error {
	c.mu.Lock()
	b, err := json.MarshalIndent(c, "", "  ")
	c.mu.Unlock()
	if err != nil {
		return fmt.Errorf("marshal state: %w", err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("write state %s: %w", path, err)
	}
	return nil
}

// LoadState reads a state file written by SaveState; Stop on the result stops that cluster.
func LoadState(path string, logf func(string, ...any)) (*Cluster, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read state: %w", err)
	}
	c := &Cluster{logf: logf}
	if err := json.Unmarshal(b, c); err != nil {
		return nil, fmt.Errorf("parse state %s: %w", path, err)
	}
	return c, nil
}

// freePorts reserves n distinct loopback ports by listening on :0, then releases them. The
// window until the component binds is tiny and only other local processes can race for it.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("reserve port: %w", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

var (
	plainHTTP     = &http.Client{Timeout: 2 * time.Second}
	insecureHTTPS = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		// Only used for /healthz of components whose self-signed serving certs we did not make.
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
	}}
)

func httpOK(client *http.Client, url string) func(context.Context) (bool, error) {
	return func(ctx context.Context) (bool, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false, err
		}
		resp, err := client.Do(req)
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, fmt.Errorf("%s: %s", url, resp.Status)
		}
		return true, nil
	}
}

// nodeReady reports whether the node's Ready condition is True.
func nodeReady(n *corev1.Node) bool {
	for _, cond := range n.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}
