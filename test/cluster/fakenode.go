package cluster

import (
	"context"
	"fmt"
	"maps"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// leaseDuration matches kubelet's default node lease; the heartbeat renews at a quarter of it,
// well inside kube-controller-manager's --node-monitor-grace-period (50 s), so the node
// lifecycle controller never marks the node NotReady or taints it during a test.
const leaseDuration = 40 * time.Second

// CreateReadyNode registers a Node without a kubelet and reports it Ready, so the real scheduler
// places pods on it (spec.nodeName, and volume.kubernetes.io/selected-node on
// WaitForFirstConsumer PVCs). Pods never start there. A heartbeat goroutine renews the node's
// Lease until Stop; it lives in this process, so nodes made through a cluster loaded from a
// state file go NotReady once their creator exits.
func (c *Cluster) CreateReadyNode(ctx context.Context, name string, labels map[string]string) error {
	cs, err := c.Client()
	if err != nil {
		return err
	}
	l := map[string]string{
		"kubernetes.io/hostname": name,
		"kubernetes.io/os":       "linux",
		"kubernetes.io/arch":     "amd64",
	}
	maps.Copy(l, labels)
	node, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: l}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create node %s: %w", name, err)
	}
	// The node lifecycle controller updates new nodes too (taints, annotations): retry on
	// conflict against the latest version.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		latest, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		capacity := corev1.ResourceList{
			corev1.ResourceCPU:              resource.MustParse("8"),
			corev1.ResourceMemory:           resource.MustParse("32Gi"),
			corev1.ResourcePods:             resource.MustParse("110"),
			corev1.ResourceEphemeralStorage: resource.MustParse("100Gi"),
		}
		latest.Status = corev1.NodeStatus{
			Capacity:    capacity,
			Allocatable: capacity,
			Phase:       corev1.NodeRunning,
			Addresses:   []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: name}},
			NodeInfo:    corev1.NodeSystemInfo{OperatingSystem: "linux", Architecture: "amd64", KubeletVersion: "v1.37.2"},
		}
		for _, t := range []corev1.NodeConditionType{corev1.NodeMemoryPressure, corev1.NodeDiskPressure, corev1.NodePIDPressure, corev1.NodeNetworkUnavailable} {
			latest.Status.Conditions = append(latest.Status.Conditions, corev1.NodeCondition{Type: t, Status: corev1.ConditionFalse,
				LastHeartbeatTime: now, LastTransitionTime: now, Reason: "DirpvFakeNode"})
		}
		latest.Status.Conditions = append(latest.Status.Conditions, corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
			LastHeartbeatTime: now, LastTransitionTime: now, Reason: "DirpvFakeNode", Message: "fake node created by test/cluster"})
		_, err = cs.CoreV1().Nodes().UpdateStatus(ctx, latest, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("set node %s Ready: %w", name, err)
	}

	lease := &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: corev1.NamespaceNodeLease,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: name, UID: node.UID}}},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity:       ptr.To(name),
			LeaseDurationSeconds: ptr.To(int32(leaseDuration / time.Second)),
			RenewTime:            &metav1.MicroTime{Time: time.Now()},
		},
	}
	// kube-node-lease is created by the apiserver shortly after it starts serving.
	err = poll(ctx, 30*time.Second, 200*time.Millisecond, "create lease for "+name, nil, func(ctx context.Context) (bool, error) {
		_, err := cs.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, lease, metav1.CreateOptions{})
		if apierrors.IsNotFound(err) {
			return false, err
		}
		return err == nil || apierrors.IsAlreadyExists(err), err
	})
	if err != nil {
		return err
	}

	beatCtx, cancel := context.WithCancel(context.Background())
	c.mu.Lock()
	c.stopBeats = append(c.stopBeats, cancel)
	c.mu.Unlock()
	c.beatsWG.Add(1)
	go func() {
		defer c.beatsWG.Done()
		wait.UntilWithContext(beatCtx, func(ctx context.Context) {
			rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
			defer rcancel()
			l, err := cs.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(rctx, name, metav1.GetOptions{})
			if err == nil {
				l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
				_, err = cs.CoordinationV1().Leases(corev1.NamespaceNodeLease).Update(rctx, l, metav1.UpdateOptions{})
			}
			if apierrors.IsNotFound(err) {
				cancel() // the test deleted its node, and the lease went with it
			} else if err != nil && ctx.Err() == nil {
				c.logf("renew lease of fake node %s: %v", name, err)
			}
		}, leaseDuration/4)
	}()
	return nil
}

// RegisterCSIDriver lists driver in the node's CSINode object, as kubelet does when a CSI node
// plugin registers with it. Fake nodes have no kubelet, so a test that runs a plugin "on" one
// says so here; the object is owned by the Node and goes with it.
func (c *Cluster) RegisterCSIDriver(ctx context.Context, nodeName, driver string) error {
	cs, err := c.Client()
	if err != nil {
		return err
	}
	node, err := cs.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("register %s on node %s: %w", driver, nodeName, err)
	}
	entry := storagev1.CSINodeDriver{Name: driver, NodeID: nodeName}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		csiNode, err := cs.StorageV1().CSINodes().Get(ctx, nodeName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = cs.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
				ObjectMeta: metav1.ObjectMeta{Name: nodeName,
					OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: nodeName, UID: node.UID}}},
				Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{entry}},
			}, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		for _, d := range csiNode.Spec.Drivers {
			if d.Name == driver {
				return nil
			}
		}
		csiNode.Spec.Drivers = append(csiNode.Spec.Drivers, entry)
		_, err = cs.StorageV1().CSINodes().Update(ctx, csiNode, metav1.UpdateOptions{})
		return err
	})
}
