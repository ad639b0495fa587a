// Package csinode is dirpv's CSI node plugin: the CSI Identity and Node services that kubelet
// calls to mount a dirpv volume into a pod, the kubelet plugin-registration service that makes
// kubelet find the plugin without a node-driver-registrar sidecar, and volume statistics.
//
// dirpv has no CSI controller (volumes are created by its lib-external-provisioner), and its
// CSIDriver has attachRequired: false, so kubelet calls NodePublishVolume directly. Everything
// the plugin needs to find a volume is in the PV's volumeAttributes, parsed by package volume.
package csinode

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// DefaultOperationTimeout bounds a single mount, unmount or statfs when Options leaves
// OperationTimeout zero. It is well below kubelet's own two-minute CSI call timeout so that the
// plugin answers DeadlineExceeded itself instead of kubelet giving up on a silent call.
const DefaultOperationTimeout = 30 * time.Second

// TopologyKey is the topology segment NodeGetInfo reports; kubelet copies it to the CSINode
// object and the node label, and local PVs carry node affinity on it.
const TopologyKey = "topology.dirpv.io/node"

// Options configure a Driver.
type Options struct {
	// DriverName is the CSI driver name, "dirpv.io" in production.
	DriverName string
	// Version is reported by GetPluginInfo as the vendor version.
	Version string
	// NodeID is this node's name; NodeGetInfo reports it and the topology segment.
	NodeID string
	// Endpoint is where the CSI Identity and Node services listen, "unix:///path/csi.sock".
	Endpoint string
	// KubeletEndpoint is the CSI socket path as kubelet sees it, reported to kubelet during
	// registration. Empty means Endpoint's path, which is right when the plugin's socket
	// directory is mounted at the same path in the container as on the host.
	KubeletEndpoint string
	// RegistrationDir is kubelet's plugins_registry directory. The plugin puts its
	// registration socket there so that kubelet's plugin watcher finds it. Empty disables
	// self-registration (tests, or a deployment that still runs node-driver-registrar).
	RegistrationDir string
	// Mounter performs mounts; nil means mount.New(""), the system's mount(8). Tests hand
	// in fakes.
	Mounter mount.Interface
	// OperationTimeout caps each mount, unmount and statfs (the request's own deadline applies
	// too, whichever is earlier). Zero means DefaultOperationTimeout.
	OperationTimeout time.Duration
	// LocalBases are where local volumes may be bind-mounted from; a PV naming any other
	// basePath, or a directory in or around kubelet's root dir, is refused. Required: a PV is
	// written by whoever may create PVs, and the plugin mounts as root.
	LocalBases *volume.AllowedBases
}

// Driver serves dirpv's CSI node plugin. Create it with NewDriver and serve it with Run.
type Driver struct {
	opts       Options
	mounter    mount.Interface
	socketPath string // CSI socket
	regPath    string // registration socket, "" when self-registration is off

	locks     *keyedLock
	published *publishedSet
	statfs    *singleFlight
	metrics   *metrics

	mu      sync.Mutex
	serving bool
}

// driverNameRE is the CSI spec's rule for plugin names (at most 63 characters, DNS-like).
var driverNameRE = regexp.MustCompile(`^[a-zA-Z0-9]([a-zA-Z0-9.\-_]{0,61}[a-zA-Z0-9])?$`)

// NewDriver checks the options and returns a driver that is not serving yet.
func NewDriver(opts Options) (*Driver, error) {
	if !driverNameRE.MatchString(opts.DriverName) {
		return nil, fmt.Errorf("driver name %q is not a valid CSI plugin name", opts.DriverName)
	}
	if opts.Version == "" {
		return nil, errors.New("version must not be empty")
	}
	if opts.NodeID == "" {
		return nil, errors.New("node ID must not be empty")
	}
	socketPath, err := parseUnixEndpoint(opts.Endpoint)
	if err != nil {
		return nil, err
	}
	if opts.KubeletEndpoint != "" && !filepath.IsAbs(opts.KubeletEndpoint) {
		return nil, fmt.Errorf("kubelet endpoint %q must be an absolute socket path", opts.KubeletEndpoint)
	}
	if opts.RegistrationDir != "" && !filepath.IsAbs(opts.RegistrationDir) {
		return nil, fmt.Errorf("registration directory %q must be absolute", opts.RegistrationDir)
	}
	if opts.LocalBases == nil {
		return nil, errors.New("allowed local base paths are required")
	}
	if opts.OperationTimeout < 0 {
		return nil, fmt.Errorf("operation timeout %v must not be negative", opts.OperationTimeout)
	}
	if opts.OperationTimeout == 0 {
		opts.OperationTimeout = DefaultOperationTimeout
	}
	d := &Driver{
		opts:       opts,
		mounter:    opts.Mounter,
		socketPath: socketPath,
		locks:      newKeyedLock(),
		published:  newPublishedSet(),
		statfs:     newSingleFlight(),
		metrics:    newMetrics(),
	}
	if d.mounter == nil {
		d.mounter = mount.New("")
	}
	if opts.RegistrationDir != "" {
		d.regPath = filepath.Join(opts.RegistrationDir, opts.DriverName+"-reg.sock")
	}
	return d, nil
}

// parseUnixEndpoint accepts unix:///abs/path (and unix:/abs/path, as gRPC does).
func parseUnixEndpoint(ep string) (string, error) {
	p, ok := strings.CutPrefix(ep, "unix://")
	if !ok {
		p, ok = strings.CutPrefix(ep, "unix:")
	}
	if !ok || !filepath.IsAbs(p) {
		return "", fmt.Errorf("endpoint %q: want unix:///absolute/path.sock", ep)
	}
	return filepath.Clean(p), nil
}

// Run serves the CSI Identity and Node services on the endpoint and, if configured, the
// registration service in kubelet's plugin registry, until ctx is done. It then stops
// accepting calls, lets running ones finish (each is bounded by OperationTimeout), removes its
// sockets and returns nil. It returns an error if a socket cannot be set up or a server fails.
func (d *Driver) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("driver", d.opts.DriverName, "node", d.opts.NodeID)
	ctx = klog.NewContext(ctx, logger)

	csiLis, err := listenUnix(d.socketPath)
	if err != nil {
		return err
	}
	csiSrv := grpc.NewServer(grpc.ChainUnaryInterceptor(logInterceptor(logger), d.metrics.interceptor()))
	csi.RegisterIdentityServer(csiSrv, &identityServer{d: d})
	csi.RegisterNodeServer(csiSrv, &nodeServer{d: d})

	errCh := make(chan error, 2)
	var wg sync.WaitGroup
	serve := func(name string, srv *grpc.Server, lis net.Listener) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := srv.Serve(lis); err != nil {
				errCh <- fmt.Errorf("serve %s: %w", name, err)
			}
		}()
	}
	// The CSI socket must accept calls before kubelet learns about it through registration.
	serve("CSI endpoint "+d.socketPath, csiSrv, csiLis)
	servers := []*grpc.Server{csiSrv}
	sockets := []string{d.socketPath}

	if d.regPath != "" {
		regLis, err := listenUnix(d.regPath)
		if err != nil {
			csiSrv.Stop()
			wg.Wait()
			removeSocket(d.socketPath)
			return err
		}
		regSrv := grpc.NewServer(grpc.ChainUnaryInterceptor(logInterceptor(logger)))
		registerapi.RegisterRegistrationServer(regSrv, d.newRegistrationServer())
		serve("registration endpoint "+d.regPath, regSrv, regLis)
		servers = append(servers, regSrv)
		sockets = append(sockets, d.regPath)
	}
	d.setServing(true)
	logger.Info("CSI node plugin serving", "endpoint", d.socketPath, "registration", d.regPath)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errCh:
	}
	d.setServing(false)
	// Removing the registration socket first tells kubelet's plugin watcher that the plugin is
	// going away before the CSI socket stops answering.
	for i := len(servers) - 1; i >= 0; i-- {
		removeSocket(sockets[i])
		gracefulStop(servers[i], d.opts.OperationTimeout+5*time.Second)
	}
	wg.Wait()
	logger.Info("CSI node plugin stopped")
	return runErr
}

// gracefulStop lets running calls finish but not forever: a call is bounded by the operation
// timeout, so one that outlives it is stuck and is cut off.
func gracefulStop(srv *grpc.Server, limit time.Duration) {
	done := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(limit)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		srv.Stop()
		<-done
	}
}

func (d *Driver) setServing(v bool) {
	d.mu.Lock()
	d.serving = v
	d.mu.Unlock()
}

// Ready reports whether the plugin serves: both gRPC servers run and their sockets are still
// in place (a deleted socket makes the plugin unreachable for kubelet while the process looks
// alive, which a liveness probe should catch). It is meant for /healthz.
func (d *Driver) Ready() error {
	d.mu.Lock()
	serving := d.serving
	d.mu.Unlock()
	if !serving {
		return errors.New("CSI node plugin is not serving")
	}
	for _, p := range []string{d.socketPath, d.regPath} {
		if p == "" {
			continue
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return fmt.Errorf("socket missing: %w", err)
		}
		if fi.Mode()&os.ModeSocket == 0 {
			return fmt.Errorf("%s is no longer a socket", p)
		}
	}
	return nil
}

// listenUnix listens on a unix socket at path, replacing a stale socket left by a previous
// instance. Anything else at the path is left alone and reported.
func listenUnix(path string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
	fi, err := os.Lstat(path)
	switch {
	case err == nil && fi.Mode()&os.ModeSocket != 0:
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	case err == nil:
		return nil, fmt.Errorf("%s exists and is not a socket; refusing to replace it", path)
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("check socket path: %w", err)
	}
	lis, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// net.UnixListener would remove the socket on Close; Run removes it itself, in order.
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	// Only root (kubelet) talks to the plugin.
	if err := os.Chmod(path, 0o600); err != nil {
		lis.Close()
		return nil, fmt.Errorf("restrict socket %s: %w", path, err)
	}
	return lis, nil
}

func removeSocket(path string) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		klog.Background().Error(err, "Failed to remove socket", "path", path)
	}
}
