package framework

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// SetClaimSize sets the claim's storage request, as `kubectl edit` would.
func SetClaimSize(ctx context.Context, c kubernetes.Interface, ns, name, size string) error {
	patch := fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)
	_, err := c.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

// resizeConditions are the claim conditions of a resize in progress or failed; others (such
// as Unused) say nothing about it.
var resizeConditions = map[v1.PersistentVolumeClaimConditionType]bool{
	v1.PersistentVolumeClaimResizing:                true,
	v1.PersistentVolumeClaimFileSystemResizePending: true,
	v1.PersistentVolumeClaimControllerResizeError:   true,
	v1.PersistentVolumeClaimNodeResizeError:         true,
}

// WaitForClaimResized waits until the claim and its PV report size and the claim carries no
// resize condition or status any more: what `kubectl get pvc` shows once a resize is done.
func WaitForClaimResized(ctx context.Context, c kubernetes.Interface, ns, name, size string, timeout time.Duration) (*v1.PersistentVolumeClaim, error) {
	want := resource.MustParse(size)
	var pvc *v1.PersistentVolumeClaim
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		pvc, err = c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		got, pvSize := pvc.Status.Capacity[v1.ResourceStorage], pv.Spec.Capacity[v1.ResourceStorage]
		var resizing []v1.PersistentVolumeClaimCondition
		for _, c := range pvc.Status.Conditions {
			if resizeConditions[c.Type] {
				resizing = append(resizing, c)
			}
		}
		if got.Cmp(want) != 0 || pvSize.Cmp(want) != 0 || len(resizing) != 0 || len(pvc.Status.AllocatedResourceStatuses) != 0 {
			return false, fmt.Errorf("claim capacity %s, PV capacity %s, resize conditions %+v, allocatedResourceStatuses %v",
				got.String(), pvSize.String(), resizing, pvc.Status.AllocatedResourceStatuses)
		}
		return true, nil
	})
	if err != nil {
		return pvc, fmt.Errorf("claim %s/%s resized to %s: %w", ns, name, size, err)
	}
	return pvc, nil
}
