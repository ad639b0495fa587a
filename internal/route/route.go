// Package route labels the claims and PVs of local volumes with their node
// (provisioner.LabelNode), so that every dirpv node instance can watch its own and nothing
// else. It runs in dirpv controller, which watches every claim and PV anyway.
package route

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	coreinformers "k8s.io/client-go/informers/core/v1"
	storageinformers "k8s.io/client-go/informers/storage/v1"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/provisioner"
)

// key names a claim (namespace set) or a PV (namespace empty) to look at.
type key struct {
	namespace, name string
	volume          bool
}

// Controller patches each claim and PV whose node label is missing or wrong
// (provisioner.ClaimLabel, provisioner.VolumeNode). It only ever adds or replaces that one
// label, with a JSON merge patch, which carries no resourceVersion: it fails on no concurrent
// change, and applying it twice changes nothing.
type Controller struct {
	client  kubernetes.Interface
	driver  string
	timeout time.Duration
	claims  corelisters.PersistentVolumeClaimLister
	volumes corelisters.PersistentVolumeLister
	classes storagelisters.StorageClassLister
	synced  []cache.InformerSynced
	queue   workqueue.TypedRateLimitingInterface[key]
}

// New returns the controller of driver's claims and PVs, fed by the given shared informers.
// timeout bounds each patch.
func New(client kubernetes.Interface, driver string, timeout time.Duration,
	claims coreinformers.PersistentVolumeClaimInformer, volumes coreinformers.PersistentVolumeInformer,
	classes storageinformers.StorageClassInformer,
) (*Controller, error) {
	c := &Controller{
		client: client, driver: driver, timeout: timeout,
		claims: claims.Lister(), volumes: volumes.Lister(), classes: classes.Lister(),
		synced: []cache.InformerSynced{claims.Informer().HasSynced, volumes.Informer().HasSynced, classes.Informer().HasSynced},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[key](),
			workqueue.TypedRateLimitingQueueConfig[key]{Name: "route"}),
	}
	// Only objects that need a patch are queued: every claim update of the cluster arrives
	// here, and almost all of them need nothing.
	claimChanged := func(obj any) {
		if claim, ok := obj.(*v1.PersistentVolumeClaim); ok && c.claimPatch(claim) != nil {
			c.queue.Add(key{namespace: claim.Namespace, name: claim.Name})
		}
	}
	volumeChanged := func(obj any) {
		if pv, ok := obj.(*v1.PersistentVolume); ok && volumePatch(pv, driver) != nil {
			c.queue.Add(key{name: pv.Name, volume: true})
		}
	}
	// A claim made before its class is labelled once the class exists.
	classChanged := func(obj any) {
		class, ok := obj.(*storagev1.StorageClass)
		if !ok || class.Provisioner != driver {
			return
		}
		all, err := c.claims.List(labels.Everything())
		if err != nil {
			return
		}
		for _, claim := range all {
			if ptr.Deref(claim.Spec.StorageClassName, "") == class.Name {
				claimChanged(claim)
			}
		}
	}
	for _, reg := range []struct {
		informer cache.SharedIndexInformer
		changed  func(any)
	}{{claims.Informer(), claimChanged}, {volumes.Informer(), volumeChanged}, {classes.Informer(), classChanged}} {
		if _, err := reg.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    reg.changed,
			UpdateFunc: func(_, obj any) { reg.changed(obj) },
		}); err != nil {
			return nil, fmt.Errorf("route: watch: %w", err)
		}
	}
	return c, nil
}

// Run patches with the given number of workers until ctx is done, and returns once they have
// stopped. Every object of the informers' initial lists passes through the handlers, so what
// was left unlabelled while no controller ran (or before this version) is labelled first.
func (c *Controller) Run(ctx context.Context, workers int) {
	logger := klog.FromContext(ctx)
	defer c.queue.ShutDown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced...) {
		return
	}
	logger.Info("Labelling local claims and volumes with their node", "label", provisioner.LabelNode)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for c.next(ctx) {
			}
		})
	}
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
}

func (c *Controller) next(ctx context.Context) bool {
	k, shutdown := c.queue.Get()
	if shutdown {
		return false
	}
	defer c.queue.Done(k)
	if err := c.sync(ctx, k); err != nil {
		klog.FromContext(ctx).Error(err, "Label with node; retrying", "namespace", k.namespace, "name", k.name)
		c.queue.AddRateLimited(k)
		return true
	}
	c.queue.Forget(k)
	return true
}

func (c *Controller) sync(ctx context.Context, k key) error {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	var err error
	if k.volume {
		pv, getErr := c.volumes.Get(k.name)
		if apierrors.IsNotFound(getErr) {
			return nil
		}
		patch := volumePatch(pv, c.driver)
		if getErr != nil || patch == nil {
			return getErr
		}
		_, err = c.client.CoreV1().PersistentVolumes().Patch(ctx, k.name, types.MergePatchType, patch, metav1.PatchOptions{})
	} else {
		claim, getErr := c.claims.PersistentVolumeClaims(k.namespace).Get(k.name)
		if apierrors.IsNotFound(getErr) {
			return nil
		}
		patch := c.claimPatch(claim)
		if getErr != nil || patch == nil {
			return getErr
		}
		_, err = c.client.CoreV1().PersistentVolumeClaims(k.namespace).Patch(ctx, k.name, types.MergePatchType, patch, metav1.PatchOptions{})
	}
	switch {
	case apierrors.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("patch node label: %w", err)
	}
	klog.FromContext(ctx).V(4).Info("Labelled with node", "namespace", k.namespace, "name", k.name)
	return nil
}

// claimPatch returns the patch the claim needs, or nil.
func (c *Controller) claimPatch(claim *v1.PersistentVolumeClaim) []byte {
	class, err := c.classes.Get(ptr.Deref(claim.Spec.StorageClassName, ""))
	if err != nil {
		return nil
	}
	var pv *v1.PersistentVolume
	if claim.Spec.VolumeName != "" {
		pv, _ = c.volumes.Get(claim.Spec.VolumeName)
	}
	node, ok := provisioner.ClaimLabel(claim, class, pv, c.driver)
	if !ok {
		return nil
	}
	return labelPatch(node)
}

// volumePatch returns the patch the PV needs, or nil.
func volumePatch(pv *v1.PersistentVolume, driver string) []byte {
	node, ok := provisioner.VolumeNode(pv, driver)
	if !ok || pv.Labels[provisioner.LabelNode] == provisioner.NodeLabel(node) {
		return nil
	}
	return labelPatch(provisioner.NodeLabel(node))
}

// labelPatch is the JSON merge patch that sets the node label to value.
func labelPatch(value string) []byte {
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{provisioner.LabelNode: value}}})
	return patch
}
