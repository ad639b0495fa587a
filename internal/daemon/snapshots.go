package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	snapscheme "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/scheme"
	snapinformers "github.com/kubernetes-csi/external-snapshotter/client/v8/informers/externalversions"
	snaplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumesnapshot/v1"
	commoncontroller "github.com/kubernetes-csi/external-snapshotter/v8/pkg/common-controller"
	snapfeatures "github.com/kubernetes-csi/external-snapshotter/v8/pkg/features"
	snapmetrics "github.com/kubernetes-csi/external-snapshotter/v8/pkg/metrics"
	sidecarcontroller "github.com/kubernetes-csi/external-snapshotter/v8/pkg/sidecar-controller"
	snaputils "github.com/kubernetes-csi/external-snapshotter/v8/pkg/utils"
	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/volume"
)

// snapshotAPIBackoff is how a process whose cluster lacks the VolumeSnapshot CRDs looks for
// them again: snapshots start working once they are installed, without a restart. The wait
// doubles up to 10 minutes: on a cluster that never installs them (kind's default), every
// node would otherwise ask discovery every 30 s for ever (1000 nodes, 33 requests a second).
// The jitter spreads nodes started together.
var snapshotAPIBackoff = wait.Backoff{Duration: 30 * time.Second, Factor: 2, Jitter: 0.1, Steps: math.MaxInt32, Cap: 10 * time.Minute}

// Retry bounds of failed or not yet ready snapshot operations, in both controllers.
// external-snapshotter's default start; a lower ceiling than its 5 minutes, since a copy that
// is not ready yet is polled this way too.
const (
	snapshotRetryStart = time.Second
	snapshotRetryMax   = 30 * time.Second
)

var snapshotSetup sync.Once

// setupSnapshots registers the snapshot types with client-go's scheme, so that events on
// VolumeSnapshots and their contents can be recorded, and lets external-snapshotter's
// controllers count their workers in the WaitGroup given to Run (its
// ReleaseLeaderElectionOnExit gate), so that dirpv waits for them before it releases storage
// or its lease.
func setupSnapshots() {
	snapshotSetup.Do(func() {
		if err := snapscheme.AddToScheme(scheme.Scheme); err != nil {
			panic(err)
		}
		if err := utilfeature.DefaultMutableFeatureGate.SetFromMap(map[string]bool{string(snapfeatures.ReleaseLeaderElectionOnExit): true}); err != nil {
			panic(err)
		}
	})
}

// waitForSnapshotAPI returns true once the API server serves VolumeSnapshotContents and
// VolumeSnapshotClasses, false if ctx ends first.
func waitForSnapshotAPI(ctx context.Context, d discovery.DiscoveryInterface) bool {
	logger := klog.FromContext(ctx)
	gv := snapshotv1.SchemeGroupVersion.String()
	logged := false
	err := snapshotAPIBackoff.DelayFunc().Until(ctx, true, true, func(ctx context.Context) (bool, error) {
		list, err := d.ServerResourcesForGroupVersion(gv)
		found := map[string]bool{}
		if err == nil {
			for _, r := range list.APIResources {
				found[r.Name] = true
			}
		}
		if found["volumesnapshots"] && found["volumesnapshotcontents"] && found["volumesnapshotclasses"] {
			return true, nil
		}
		if !logged {
			logger.Info("VolumeSnapshots are off until the snapshot CRDs are installed (deploy/components/snapshots)", "groupVersion", gv, "err", err)
			logged = true
		}
		return false, nil
	})
	return err == nil
}

// snapshotting returns what runs external-snapshotter's sidecar controller around s until its
// context is done, once the snapshot CRDs exist. managedBy is the node whose contents it
// serves (the common controller labels those of local volumes with their node); empty, it
// serves the contents without that label: NFS volumes'. Its informers are its own, since
// contents and classes are no part of the process's shared factory. What it returns comes
// back once the sidecar's workers and s's copies have stopped.
//
// It registers dirpv_snapshot_used_bytes on reg, read from the sidecar's contents while it runs,
// and has pub refresh its capacity when a snapshot takes or frees space.
func snapshotting(snapClient snapclientset.Interface, client kubernetes.Interface, s *provisioner.Snapshotter, managedBy string, cfg ProvisionerConfig,
	reg prometheus.Registerer, pub *capacityPublisher,
) func(context.Context) {
	setupSnapshots()
	s.SetSpaceChanged(pub.refresh)
	var running atomic.Pointer[snaplisters.VolumeSnapshotContentLister]
	reg.MustRegister(s.SnapshotsCollector(func() snaplisters.VolumeSnapshotContentLister {
		if l := running.Load(); l != nil {
			return *l
		}
		return nil
	}))
	return func(ctx context.Context) {
		copies, stopCopies := context.WithCancel(context.WithoutCancel(ctx))
		waitCopies := s.Start(copies)
		defer func() {
			stopCopies()
			waitCopies()
		}()
		if !waitForSnapshotAPI(ctx, client.Discovery()) {
			return
		}
		op := selection.DoesNotExist
		var values []string
		if managedBy != "" {
			op, values = selection.Equals, []string{managedBy}
		}
		req, err := labels.NewRequirement(snaputils.VolumeSnapshotContentManagedByLabel, op, values)
		if err != nil {
			panic(err) // a constant key
		}
		classes := snapinformers.NewSharedInformerFactory(snapClient, cfg.Resync)
		selected := snapinformers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = req.String() })
		contents := snapinformers.NewSharedInformerFactoryWithOptions(snapClient, cfg.Resync, selected)
		var unlabelled snapinformers.SharedInformerFactory
		if managedBy == "" {
			// Pre-provisioned contents (a snapshot handle given by hand, or copied from
			// another content) get no node label from the common controller; the controller
			// labels those of local snapshots for their node, whose sidecar then serves them.
			// The controller's own sidecar must not touch them meanwhile: it would write
			// them "not ready", and the node's sidecar, which takes status changes for its
			// own, would not look again until a resync (15 min), so they would stay not ready.
			unlabelled = snapinformers.NewSharedInformerFactoryWithOptions(snapClient, cfg.Resync, selected)
			handler := func(obj any) { labelForNode(ctx, snapClient, obj) }
			_, err := unlabelled.Snapshot().V1().VolumeSnapshotContents().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
				AddFunc:    handler,
				UpdateFunc: func(_, obj any) { handler(obj) },
			})
			if err != nil {
				panic(err) // only refused once the informer has stopped
			}
			if err := contents.Snapshot().V1().VolumeSnapshotContents().Informer().SetTransform(hideNodeContents); err != nil {
				panic(err) // only refused once the informer has started
			}
		}
		ctrl := sidecarcontroller.NewCSISnapshotSideCarController(snapClient, client, DriverName,
			contents.Snapshot().V1().VolumeSnapshotContents(), classes.Snapshot().V1().VolumeSnapshotClasses(),
			s, nil, cfg.OperationTimeout, cfg.Resync,
			// The sidecar's defaults: snapshot-<VolumeSnapshot UID>.
			provisioner.SnapshotNamePrefix, -1, "groupsnapshot", -1,
			false, workqueue.NewTypedItemExponentialFailureRateLimiter[string](snapshotRetryStart, snapshotRetryMax),
			// No volume group snapshots: dirpv has no consistency across volumes to offer.
			false, nil, nil, workqueue.NewTypedItemExponentialFailureRateLimiter[string](snapshotRetryStart, snapshotRetryMax))
		lister := contents.Snapshot().V1().VolumeSnapshotContents().Lister()
		running.Store(&lister)
		defer running.Store(nil)
		classes.Start(ctx.Done())
		contents.Start(ctx.Done())
		if unlabelled != nil {
			unlabelled.Start(ctx.Done())
			defer unlabelled.Shutdown()
		}
		var workers sync.WaitGroup
		ctrl.Run(cfg.Workers, ctx.Done(), &workers)
		workers.Wait()
		classes.Shutdown()
		contents.Shutdown()
	}
}

// hideNodeContents is the transform of the controller's sidecar's contents: an unlabelled
// content naming a local snapshot loses its driver there, so that the sidecar passes it by
// as another driver's until it is labelled for its node and leaves this informer.
func hideNodeContents(obj any) (any, error) {
	if localSnapshotNode(obj) != "" {
		obj.(*snapshotv1.VolumeSnapshotContent).Spec.Driver = ""
	}
	return obj, nil
}

// localSnapshotNode returns the node of obj if it is an unlabelled VolumeSnapshotContent of
// dirpv's naming a local snapshot, else "".
func localSnapshotNode(obj any) string {
	content, ok := obj.(*snapshotv1.VolumeSnapshotContent)
	if !ok || content.Spec.Driver != DriverName || content.Labels[snaputils.VolumeSnapshotContentManagedByLabel] != "" {
		return ""
	}
	handle := content.Spec.Source.SnapshotHandle
	if content.Status != nil && content.Status.SnapshotHandle != nil {
		handle = content.Status.SnapshotHandle
	}
	if handle == nil {
		return ""
	}
	h, err := volume.ParseSnapshotHandle(*handle)
	if err != nil || h.Backend != volume.BackendLocal {
		return ""
	}
	return h.Node
}

// labelForNode labels obj, a VolumeSnapshotContent of dirpv's naming a local snapshot, with
// the snapshot's node (snapshot.storage.kubernetes.io/managed-by), as distributed
// snapshotting labels the contents it makes.
func labelForNode(ctx context.Context, c snapclientset.Interface, obj any) {
	node := localSnapshotNode(obj)
	if node == "" {
		return
	}
	content := obj.(*snapshotv1.VolumeSnapshotContent)
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{snaputils.VolumeSnapshotContentManagedByLabel: node}}})
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	logger := klog.FromContext(ctx).WithValues("content", content.Name, "node", node)
	if _, err := c.SnapshotV1().VolumeSnapshotContents().Patch(ctx, content.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		// The next resync tries again.
		logger.Error(err, "Labelling a local snapshot's content for its node")
		return
	}
	logger.Info("Labelled a local snapshot's content for its node")
}

// SnapshotControllerConfig configures `dirpv snapshot-controller`.
type SnapshotControllerConfig struct {
	Kube           KubeConfig
	Workers        int
	Resync         time.Duration
	LeaderElection LeaderElectionConfig
	HTTPAddress    string
}

// snapshotControllerLease is the Lease the snapshot controller replicas compete for.
const snapshotControllerLease = "dirpv-snapshot-controller"

// RunSnapshotController runs external-snapshotter's common snapshot controller, the one that
// binds VolumeSnapshots to VolumeSnapshotContents for every CSI driver, until ctx is done:
// for clusters that do not run one. It labels the contents of node-local volumes with their
// node (distributed snapshotting), which is how each `dirpv node` finds its own.
func RunSnapshotController(ctx context.Context, cfg SnapshotControllerConfig) error {
	setupSnapshots()
	client, err := cfg.Kube.client()
	if err != nil {
		return err
	}
	snapClient, err := cfg.Kube.snapshotClient()
	if err != nil {
		return err
	}
	if cfg.LeaderElection.Lease == "" {
		cfg.LeaderElection.Lease = snapshotControllerLease
	}
	lead := func(ctx context.Context) {
		if !waitForSnapshotAPI(ctx, client.Discovery()) {
			return
		}
		factory := snapinformers.NewSharedInformerFactory(snapClient, cfg.Resync)
		// Not trimmed (newInformerFactory): the controller updates claims from its cache to
		// add and drop its finalizer, and would drop what was trimmed.
		core := informers.NewSharedInformerFactory(client, cfg.Resync)
		limiter := func() workqueue.TypedRateLimiter[string] {
			return workqueue.NewTypedItemExponentialFailureRateLimiter[string](snapshotRetryStart, snapshotRetryMax)
		}
		ctrl := commoncontroller.NewCSISnapshotCommonController(snapClient, client,
			factory.Snapshot().V1().VolumeSnapshots(), factory.Snapshot().V1().VolumeSnapshotContents(),
			factory.Snapshot().V1().VolumeSnapshotClasses(), nil, nil, nil,
			core.Core().V1().PersistentVolumeClaims(), core.Core().V1().PersistentVolumes(), core.Core().V1().Nodes(),
			snapmetrics.NewMetricsManager(), cfg.Resync, limiter(), limiter(), limiter(), limiter(),
			// Distributed snapshotting: contents of volumes with node affinity get the node's label.
			true,
			// A restore may not change the volume mode (upstream's default).
			true,
			false)
		factory.Start(ctx.Done())
		core.Start(ctx.Done())
		var workers sync.WaitGroup
		ctrl.Run(cfg.Workers, ctx.Done(), &workers)
		workers.Wait()
		factory.Shutdown()
		core.Shutdown()
	}
	run := func(ctx context.Context) error {
		lead(ctx)
		return nil
	}
	if cfg.LeaderElection.Enabled {
		leases, err := cfg.Kube.leaseClient()
		if err != nil {
			return err
		}
		run = func(ctx context.Context) error {
			return runElected(ctx, leases, cfg.LeaderElection, nil, lead)
		}
	}
	return runAll(ctx, httpConfig{address: cfg.HTTPAddress}, newRegistry(), nil, run)
}

// snapshotClient is a client of the snapshot API. JSON: custom resources do not speak protobuf.
func (k KubeConfig) snapshotClient() (snapclientset.Interface, error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, err
	}
	c, err := snapclientset.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("snapshot client: %w", err)
	}
	return c, nil
}
