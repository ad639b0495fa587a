package daemon

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kubernetes-csi/external-provisioner/v5/pkg/capacity"
	"github.com/kubernetes-csi/external-provisioner/v5/pkg/capacity/topology"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	storageinformers "k8s.io/client-go/informers/storage/v1"
	"k8s.io/client-go/kubernetes"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	v11 "sigs.k8s.io/sig-storage-lib-external-provisioner/v11/controller"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/provisioner"
)

// DefaultCapacityPollInterval is external-provisioner's --capacity-poll-interval default.
const DefaultCapacityPollInterval = time.Minute

// DefaultNamespace is the namespace deploy/ installs dirpv into.
const DefaultNamespace = "dirpv"

// CapacityConfig says how a dirpv process publishes CSIStorageCapacity objects.
type CapacityConfig struct {
	// PollInterval is how often every object is refreshed from the storage; zero or less
	// publishes nothing.
	PollInterval time.Duration
	// Namespace holds the objects: dirpv's own.
	Namespace string
	// PodName, PodUID and PodNamespace name the pod this process runs in (downward API). A node instance's
	// objects are owned by its pod, so that they go with it: with the node (the pods of a
	// deleted node are garbage collected) and with dirpv. Empty: no owner.
	PodName      string
	PodUID       string
	PodNamespace string
}

// capacityPublisher runs kubernetes-csi's capacity controller (external-provisioner's
// pkg/capacity) in-process, with the Provisioner as its CSI GetCapacity.
type capacityPublisher struct {
	p         *provisioner.Provisioner
	classes   storageinformers.StorageClassInformer
	client    kubernetes.Interface
	cfg       CapacityConfig
	managedBy string
	timeout   time.Duration
	// owner returns the owner reference of the objects (nil for none). It may need the API
	// server; run retries it, so that a process never waits for it to start serving.
	owner func(context.Context) (*metav1.OwnerReference, error)
	// ctrl is the library's controller once run has built it; nil before, when a Provision
	// or Delete has nothing to refresh yet.
	ctrl atomic.Pointer[capacity.Controller]
	// retryFirst and retryMax bound ready's back-off.
	retryFirst, retryMax time.Duration
}

// newCapacityPublisher returns the publisher of p's classes, or nil if cfg publishes nothing.
// owner and managedBy say whose objects are whose: a restarted instance finds its objects by
// managedBy and adopts them rather than create duplicates. classes is the process's shared
// informer, filtered here to the classes p publishes.
func newCapacityPublisher(client kubernetes.Interface, classes storageinformers.StorageClassInformer,
	p *provisioner.Provisioner, cfg CapacityConfig, owner func(context.Context) (*metav1.OwnerReference, error), managedBy string, timeout time.Duration,
) (*capacityPublisher, error) {
	if cfg.PollInterval <= 0 {
		return nil, nil
	}
	if cfg.Namespace == "" {
		return nil, fmt.Errorf("capacity publishing needs a namespace for CSIStorageCapacity objects")
	}
	return &capacityPublisher{p: p, classes: classes, client: client, cfg: cfg, managedBy: managedBy, timeout: timeout, owner: owner,
		retryFirst: 2 * time.Second, retryMax: 30 * time.Second}, nil
}

// ownerCheckInterval is how often a publisher makes sure its objects' owner is still the one
// it gives them: a CSIDriver deleted and created again (an uninstall and reinstall, or an
// upgrade that replaces it, as its immutable fields require) has a new UID, and objects that
// name the old one are garbage collected as soon as they are made.
const ownerCheckInterval = 10 * time.Second

// run publishes until ctx is done, starting again whenever the objects' owner is replaced.
func (c *capacityPublisher) run(ctx context.Context) {
	for ctx.Err() == nil {
		owner, segment, ok := c.ready(ctx)
		if !ok {
			return
		}
		pub, cancel := context.WithCancel(ctx)
		go func() {
			c.watchOwner(pub, owner)
			cancel()
		}()
		c.publish(pub, owner, segment)
		cancel()
	}
}

// ready returns what publishing needs from the API server first (the owner, the node's
// hostname label), retried for as long as it takes: the node plugin must serve kubelet, and
// the controller provision, while the API server is out of reach. ok is false once ctx is done.
func (c *capacityPublisher) ready(ctx context.Context) (*metav1.OwnerReference, topology.Segment, bool) {
	logger := klog.FromContext(ctx)
	// Retried with back-off up to half a minute apart, so that a cluster without a CSIDriver
	// object (which then has no use for capacity) does not fill the log, and never given up:
	// wait.ExponentialBackoff stops once its cap is reached, which left a controller that
	// started a minute before its CSIDriver publishing nothing until it restarted.
	for delay := c.retryFirst; ; delay = min(2*delay, c.retryMax) {
		lookup, cancel := context.WithTimeout(ctx, c.timeout)
		owner, segment, err := c.lookup(lookup)
		cancel()
		if err == nil {
			return owner, segment, true
		}
		logger.Error(err, "Capacity publishing waits; retrying", "in", delay)
		select {
		case <-ctx.Done():
			return nil, nil, false
		case <-time.After(delay):
		}
	}
}

// lookup reads the objects' owner and the node's topology.
func (c *capacityPublisher) lookup(ctx context.Context) (*metav1.OwnerReference, topology.Segment, error) {
	owner, err := c.owner(ctx)
	if err != nil {
		return nil, nil, err
	}
	nodeLabels, err := c.p.CapacityTopology(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("capacity topology: %w", err)
	}
	var segment topology.Segment
	for k, v := range nodeLabels {
		segment = append(segment, topology.SegmentEntry{Key: k, Value: v})
	}
	return owner, segment, nil
}

// watchOwner returns once the objects' owner is gone or another object (ctx done: at once).
// An owner that cannot be read for another reason (the API server out of reach) is kept.
func (c *capacityPublisher) watchOwner(ctx context.Context, owner *metav1.OwnerReference) {
	tick := time.NewTicker(ownerCheckInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		lookup, cancel := context.WithTimeout(ctx, c.timeout)
		now, err := c.owner(lookup)
		cancel()
		switch {
		case apierrors.IsNotFound(err):
			klog.FromContext(ctx).Info("The owner of the CSIStorageCapacity objects is gone; publishing waits for it", "err", err)
			return
		case err != nil:
		case (now == nil) != (owner == nil) || now != nil && now.UID != owner.UID:
			klog.FromContext(ctx).Info("The owner of the CSIStorageCapacity objects was replaced; publishing under the new one",
				"owner", now)
			return
		}
	}
}

// publish runs the capacity controller for owner's objects until ctx is done.
func (c *capacityPublisher) publish(ctx context.Context, owner *metav1.OwnerReference, segment topology.Segment) {
	// Only our own objects are watched: the namespace's, labelled as ours.
	selector := labels.Set{capacity.DriverNameLabel: DriverName, capacity.ManagedByLabel: c.managedBy}.String()
	objects := informers.NewSharedInformerFactoryWithOptions(c.client, 0,
		informers.WithNamespace(c.cfg.Namespace),
		informers.WithTransform(trimObject),
		informers.WithTweakListOptions(func(lo *metav1.ListOptions) { lo.LabelSelector = selector }))
	// A nil segment selects every node: external-provisioner's choice for storage without
	// topology, and one that its objects compare equal to once read back (an empty non-nil
	// one would not, and be deleted and made anew at every poll).
	topo := topology.NewFixedNodeTopology(&segment)
	ctrl := capacity.NewCentralCapacityController(
		c.p, DriverName, capacity.NewV1ClientFactory(c.client),
		workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[any](),
			workqueue.TypedRateLimitingQueueConfig[any]{Name: "csistoragecapacity"}),
		owner, c.managedBy, c.cfg.Namespace, topo,
		filteredClasses{c.classes, c.p.PublishesCapacity},
		objects.Storage().V1().CSIStorageCapacities(),
		c.cfg.PollInterval, false, c.timeout)
	c.adopt(ctx, owner, selector)
	c.ctrl.Store(ctrl)
	objects.Start(ctx.Done())
	go topo.RunWorker(ctx)
	ctrl.Run(ctx, 1)
	objects.Shutdown()
}

// adopt makes this instance the owner of the objects an earlier one left, before the library
// sees them. The library would add its owner next to the old one, which the API refuses for
// a second controller reference, and the object would keep its old figure until the old
// owner (a replaced pod that is still terminating) were gone and the object collected. Best
// effort: what fails here, the library's retries and the garbage collector still settle.
func (c *capacityPublisher) adopt(ctx context.Context, owner *metav1.OwnerReference, selector string) {
	if owner == nil {
		return
	}
	logger := klog.FromContext(ctx)
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	client := c.client.StorageV1().CSIStorageCapacities(c.cfg.Namespace)
	list, err := client.List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		logger.Error(err, "List CSIStorageCapacity objects to adopt")
		return
	}
	for i := range list.Items {
		obj := &list.Items[i]
		if ref := metav1.GetControllerOf(obj); ref == nil || ref.UID == owner.UID {
			continue
		}
		obj.OwnerReferences = []metav1.OwnerReference{*owner}
		if _, err := client.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
			logger.Error(err, "Adopt CSIStorageCapacity", "object", klog.KObj(obj))
			continue
		}
		logger.Info("Adopted CSIStorageCapacity of an earlier instance", "object", klog.KObj(obj), "class", obj.StorageClassName)
	}
}

// wrap has the objects of a node (or class) refreshed right after a Provision or Delete there,
// rather than at the next poll.
func (c *capacityPublisher) wrap(p controller.Provisioner) controller.Provisioner {
	if c == nil {
		return p
	}
	return &refreshing{Provisioner: p, pub: c}
}

// errSpaceChanged is the outcome refresh hands the library: not a Provision's, so that it
// refreshes by class.
var errSpaceChanged = errors.New("space on the storage changed")

// refresh has every object of this instance refreshed now, rather than at the next poll:
// the space on its storage changed other than by a Provision or Delete (a snapshot was made
// or deleted). The library refreshes objects for a failed Provision by class, which is what
// this hands it, for each class the instance publishes. A nil publisher does nothing.
func (c *capacityPublisher) refresh() {
	if c == nil {
		return
	}
	ctrl := c.ctrl.Load()
	if ctrl == nil {
		return
	}
	classes, err := c.classes.Lister().List(labels.Everything())
	if err != nil {
		return
	}
	w := capacity.NewProvisionWrapper(outcome{state: v11.ProvisioningFinished, err: errSpaceChanged}, ctrl)
	for _, class := range classes {
		if c.p.PublishesCapacity(class) {
			w.Provision(context.Background(), v11.ProvisionOptions{StorageClass: class})
		}
	}
}

// podOwner is the owner reference of the node instance's objects, nil outside a pod. A pod
// can only own objects of its own namespace: published elsewhere, the objects get no owner
// (the garbage collector would delete them as soon as they were made).
func podOwner(ctx context.Context, cfg CapacityConfig) func(context.Context) (*metav1.OwnerReference, error) {
	var ref *metav1.OwnerReference
	switch {
	case cfg.PodName == "" || cfg.PodUID == "":
	case cfg.PodNamespace != "" && cfg.PodNamespace != cfg.Namespace:
		klog.FromContext(ctx).Info("CSIStorageCapacity objects are published outside the pod's namespace, so the pod cannot own them: they get no owner",
			"podNamespace", cfg.PodNamespace, "capacityNamespace", cfg.Namespace)
	default:
		ref = &metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: cfg.PodName, UID: types.UID(cfg.PodUID), Controller: ptrTo(true)}
	}
	return func(context.Context) (*metav1.OwnerReference, error) { return ref, nil }
}

// driverOwner is the owner reference of the controller's objects: the CSIDriver, which goes
// with dirpv. Not a pod: replicas take over from each other while both pods exist, and the
// library adopts an object by adding its owner, which the API refuses next to another
// controller reference; every replica shares the CSIDriver. A missing CSIDriver is an error,
// retried: objects published without an owner would outlive dirpv.
func driverOwner(client kubernetes.Interface) func(context.Context) (*metav1.OwnerReference, error) {
	return func(ctx context.Context) (*metav1.OwnerReference, error) {
		d, err := client.StorageV1().CSIDrivers().Get(ctx, DriverName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("read CSIDriver %s, the owner of CSIStorageCapacity objects: %w", DriverName, err)
		}
		return &metav1.OwnerReference{APIVersion: "storage.k8s.io/v1", Kind: "CSIDriver", Name: d.Name, UID: d.UID, Controller: ptrTo(true)}, nil
	}
}

// nodeManagedBy is the managed-by label value of a node instance's objects, unique per node
// and within a label value's 63 characters, as external-provisioner names it per node.
func nodeManagedBy(node string) string {
	name := DriverName + "-node-" + node
	if len(name) <= validation.LabelValueMaxLength {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	h := hex.EncodeToString(sum[:4])
	return name[:validation.LabelValueMaxLength-len(h)-1] + "-" + h
}

func ptrTo[T any](v T) *T { return &v }

// filteredClasses is the shared StorageClass informer as seen by the capacity controller:
// only the classes keep, so that no instance publishes objects for classes it does not serve.
type filteredClasses struct {
	storageinformers.StorageClassInformer
	keep func(*storagev1.StorageClass) bool
}

func (f filteredClasses) Informer() cache.SharedIndexInformer {
	return filteredInformer{f.StorageClassInformer.Informer(), f.keep}
}

func (f filteredClasses) Lister() storagelisters.StorageClassLister {
	return filteredLister{f.StorageClassInformer.Lister(), f.keep}
}

type filteredInformer struct {
	cache.SharedIndexInformer
	keep func(*storagev1.StorageClass) bool
}

func (f filteredInformer) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	return f.SharedIndexInformer.AddEventHandler(cache.FilteringResourceEventHandler{
		FilterFunc: func(obj any) bool {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			c, ok := obj.(*storagev1.StorageClass)
			return ok && f.keep(c)
		},
		Handler: h,
	})
}

type filteredLister struct {
	storagelisters.StorageClassLister
	keep func(*storagev1.StorageClass) bool
}

func (f filteredLister) List(selector labels.Selector) ([]*storagev1.StorageClass, error) {
	all, err := f.StorageClassLister.List(selector)
	if err != nil {
		return nil, err
	}
	var out []*storagev1.StorageClass
	for _, c := range all {
		if f.keep(c) {
			out = append(out, c)
		}
	}
	return out, nil
}

func (f filteredLister) Get(name string) (*storagev1.StorageClass, error) {
	c, err := f.StorageClassLister.Get(name)
	if err != nil {
		return nil, err
	}
	if !f.keep(c) {
		return nil, apierrors.NewNotFound(storagev1.Resource("storageclasses"), name)
	}
	return c, nil
}

// refreshing hands each Provision and Delete outcome to the capacity library's own
// provisioner wrapper, which knows which objects to refresh (those of the PV's node, or of
// the class). The wrapper is written against the lib's v11 types; it gets the outcome that
// dirpv's v13 call already had.
type refreshing struct {
	controller.Provisioner
	pub *capacityPublisher
}

// guarded is what the lib looks for beyond Provision and Delete.
type guarded interface {
	controller.Qualifier
	controller.DeletionGuard
}

func (r *refreshing) Provision(ctx context.Context, opts controller.ProvisionOptions) (*corev1.PersistentVolume, controller.ProvisioningState, error) {
	pv, state, err := r.Provisioner.Provision(ctx, opts)
	if ctrl := r.pub.ctrl.Load(); ctrl != nil {
		capacity.NewProvisionWrapper(outcome{pv: pv, state: v11.ProvisioningState(state), err: err}, ctrl).
			Provision(ctx, v11.ProvisionOptions{StorageClass: opts.StorageClass, PVName: opts.PVName, PVC: opts.PVC})
	}
	return pv, state, err
}

func (r *refreshing) Delete(ctx context.Context, pv *corev1.PersistentVolume) error {
	err := r.Provisioner.Delete(ctx, pv)
	if ctrl := r.pub.ctrl.Load(); ctrl != nil {
		capacity.NewProvisionWrapper(outcome{err: err}, ctrl).Delete(ctx, pv)
	}
	return err
}

func (r *refreshing) ShouldProvision(ctx context.Context, claim *corev1.PersistentVolumeClaim) bool {
	return r.Provisioner.(guarded).ShouldProvision(ctx, claim)
}

func (r *refreshing) ShouldDelete(ctx context.Context, pv *corev1.PersistentVolume) bool {
	return r.Provisioner.(guarded).ShouldDelete(ctx, pv)
}

// outcome is a v11 Provisioner that returns what a call already returned.
type outcome struct {
	pv    *corev1.PersistentVolume
	state v11.ProvisioningState
	err   error
}

func (o outcome) Provision(context.Context, v11.ProvisionOptions) (*corev1.PersistentVolume, v11.ProvisioningState, error) {
	return o.pv, o.state, o.err
}

func (o outcome) Delete(context.Context, *corev1.PersistentVolume) error { return o.err }
