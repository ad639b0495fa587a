package daemon

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/csinode"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/volume"
)

// NodeConfig configures `dirpv node`.
type NodeConfig struct {
	Kube        KubeConfig
	Provisioner ProvisionerConfig
	NodeName    string
	// CSIEndpoint is the CSI socket, unix:///path.
	CSIEndpoint string
	// RegistrationDir is kubelet's plugins_registry directory; empty disables self-registration.
	RegistrationDir string
	// LocalProvisioning runs the local-class provisioner on this node.
	LocalProvisioning bool
	// WatchAllVolumes watches every claim and PV instead of those labelled with this node,
	// for clusters without dirpv controller, which sets the label.
	WatchAllVolumes bool
	// Capacity publishes CSIStorageCapacity for this node's local classes (with
	// LocalProvisioning).
	Capacity    CapacityConfig
	HTTPAddress string
	// Profiling serves Go's /debug/pprof/ on HTTPAddress too.
	Profiling bool
	// KubeletRootDir is kubelet's root directory; no local volume is ever in or around it.
	KubeletRootDir string
	// AllowedBasePaths are the host directories at or beneath which local volumes may live:
	// the plugin mounts no other, and the node's provisioner creates no other.
	AllowedBasePaths []string
	// QuotaCheckPeriod is how often the node checks its limited local volumes for data outside
	// their limits (provisioner.Config.QuotaCheckPeriod); 0 disables the checks.
	QuotaCheckPeriod time.Duration
	// StateDir is the node's own directory for what the node's provisioner remembers across
	// restarts: which file system each local base is (provisioner.Config.StateDir).
	StateDir string
	// MaxLocalCopies caps the copies of local volumes running at once on the node
	// (provisioner.Config.MaxLocalCopies).
	MaxLocalCopies int
}

// DefaultQuotaCheckPeriod is the default of NodeConfig.QuotaCheckPeriod.
const DefaultQuotaCheckPeriod = provisioner.DefaultQuotaCheckPeriod

// DefaultBasePath is the base of local classes that name none, and so the default allowed one.
const DefaultBasePath = provisioner.DefaultBasePath

// RunNode serves the CSI node plugin, and the local-class provisioner for this node, until ctx
// is done.
func RunNode(ctx context.Context, cfg NodeConfig) error {
	tuneGC()
	if err := checkKernel(); err != nil {
		return err
	}
	if cfg.NodeName == "" {
		return fmt.Errorf("node name is required (--node-name or NODE_NAME)")
	}
	bases, err := volume.NewAllowedBases(cfg.AllowedBasePaths, cfg.KubeletRootDir)
	if err != nil {
		return fmt.Errorf("--allowed-base-paths: %w", err)
	}
	reg := newRegistry()
	driver, err := csinode.NewDriver(csinode.Options{
		DriverName:       DriverName,
		Version:          Version,
		NodeID:           cfg.NodeName,
		Endpoint:         cfg.CSIEndpoint,
		RegistrationDir:  cfg.RegistrationDir,
		Mounter:          mount.New(""),
		OperationTimeout: cfg.Provisioner.OperationTimeout,
		LocalBases:       bases,
	})
	if err != nil {
		return err
	}
	reg.MustRegister(driver.Collectors()...)
	fns := []func(context.Context) error{driver.Run}
	if cfg.LocalProvisioning {
		client, err := cfg.Kube.client()
		if err != nil {
			return err
		}
		factory := newInformerFactory(client, cfg.Provisioner.Resync)
		if !cfg.WatchAllVolumes {
			ownVolumesOnly(factory, cfg.NodeName)
		}
		// Claims whose size this node cannot enforce are told so on the claim.
		broadcaster := record.NewBroadcaster(record.WithContext(ctx))
		broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
		defer broadcaster.Shutdown()
		snapClient, err := cfg.Kube.snapshotClient()
		if err != nil {
			return err
		}
		p, err := provisioner.New(provisioner.Config{
			Events:           broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: DriverName + "-node", Host: cfg.NodeName}),
			DriverName:       DriverName,
			Role:             provisioner.RoleNode,
			Snapshots:        snapClient,
			NodeName:         cfg.NodeName,
			AllowedBases:     bases,
			StateDir:         cfg.StateDir,
			Client:           client,
			Classes:          factory.Storage().V1().StorageClasses().Lister(),
			OperationTimeout: cfg.Provisioner.OperationTimeout,
			CloneTimeout:     cfg.Provisioner.CloneTimeout,
			CopySpaceMargin:  cfg.Provisioner.CopySpaceMargin,
			Volumes:          factory.Core().V1().PersistentVolumes().Lister(),
			QuotaCheckPeriod: cfg.QuotaCheckPeriod,
			MaxLocalCopies:   cfg.MaxLocalCopies,
			Adopt:            cfg.Provisioner.Adopt,
		})
		if err != nil {
			return err
		}
		// Every node serves its own claims, so there is no leader to elect.
		pub, err := newCapacityPublisher(client, factory.Storage().V1().StorageClasses(), p, cfg.Capacity,
			podOwner(ctx, cfg.Capacity), nodeManagedBy(cfg.NodeName), cfg.Provisioner.OperationTimeout)
		if err != nil {
			return err
		}
		// Snapshots of this node's local volumes: the common controller labels their
		// VolumeSnapshotContents with the node (distributed snapshotting).
		snapshots := snapshotting(snapClient, client, p.Snapshotter(factory.Core().V1().PersistentVolumes().Lister()), cfg.NodeName, cfg.Provisioner, reg, pub)
		lead := provisioning(ctx, client, factory, p, cfg.Provisioner, reg, pub, nodeAlso(cfg, client, factory, snapshots)...)
		fns = append(fns, func(ctx context.Context) error {
			lead(ctx)
			return nil
		}, runInformers(factory))
	}
	return runAll(ctx, httpConfig{cfg.HTTPAddress, cfg.Profiling}, reg, driver.Ready, fns...)
}

// nodeAlso returns what a node instance runs besides provisioning: snapshots, and, where no
// dirpv controller runs (WatchAllVolumes), cloningProtection. This node puts the cloning
// finalizer on the source of each local clone it copies, and without a controller nothing
// else would remove it: the source claim could never be deleted. Every node runs it then,
// which is safe: each sees every claim, so all judge a claim alike, removal is idempotent
// (a claim without the finalizer is left alone), and an update that lost the race to another
// node conflicts on its resourceVersion and is retried from the cache, finding nothing to do.
func nodeAlso(cfg NodeConfig, client kubernetes.Interface, factory informers.SharedInformerFactory, snapshots func(context.Context)) []func(context.Context) {
	also := []func(context.Context){snapshots}
	if cfg.WatchAllVolumes {
		also = append(also, cloningProtection(client, factory, cfg.Provisioner.Workers))
	}
	return also
}

// DefaultRegistrationDir is kubelet's plugin registration directory under its root dir.
func DefaultRegistrationDir(kubeletRootDir string) string {
	return filepath.Join(kubeletRootDir, "plugins_registry")
}

// DefaultStateDir is the state dir of a node plugin serving csiEndpoint: the directory of its
// socket, which the DaemonSet mounts from the host anyway (it outlives the pod) and which no
// base is on; for an endpoint that is not a unix socket, kubelet's plugin dir for dirpv.
func DefaultStateDir(csiEndpoint, kubeletRootDir string) string {
	if p, ok := strings.CutPrefix(csiEndpoint, "unix://"); ok && p != "" {
		return filepath.Dir(p)
	}
	return filepath.Join(kubeletRootDir, "plugins", DriverName)
}

// DefaultCSIEndpoint is where kubelet expects CSI plugin sockets by convention.
func DefaultCSIEndpoint(kubeletRootDir string) string {
	return "unix://" + filepath.Join(kubeletRootDir, "plugins", DriverName, "csi.sock")
}
