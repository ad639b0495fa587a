package integration

import (
	"context"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// dirpv caches claims and volumes without managedFields and kubectl's last-applied copy. When
// the lib writes such a cached PV back (here: it takes its finalizer off once an admin sets
// the reclaim policy to Retain), the server must keep both: dropping them from the cache must
// never drop them from the cluster.
func TestTrimmedCacheNeverTrimsTheServer(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, _ := localClass(t, nil)
	suite.CreateClaim(t, ns, "c", class.Name, framework.OnNode(nodeA))
	_, pv := waitBound(t, ns, "c")
	const finalizer = "external-provisioner.volume.kubernetes.io/finalizer"
	if !slices.Contains(pv.Finalizers, finalizer) {
		t.Fatalf("provisioned PV has finalizers %v, want %s", pv.Finalizers, finalizer)
	}

	// What `kubectl apply` of an edited PV leaves on it.
	applied := `{"apiVersion":"v1","kind":"PersistentVolume","spec":{"persistentVolumeReclaimPolicy":"Retain"}}`
	pv.Annotations[v1.LastAppliedConfigAnnotation] = applied
	pv.Spec.PersistentVolumeReclaimPolicy = v1.PersistentVolumeReclaimRetain
	_, err := suite.Client.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{FieldManager: "kubectl-client-side-apply"})
	must(t, err)
	t.Cleanup(func() {
		suite.Client.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
	})

	var got *v1.PersistentVolume
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		got, err = suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		return err == nil && !slices.Contains(got.Finalizers, finalizer), err
	})
	if err != nil {
		t.Fatalf("the lib never took its finalizer off the Retain PV: %v", err)
	}
	if got.Annotations[v1.LastAppliedConfigAnnotation] != applied {
		t.Errorf("the lib's write dropped %s: annotations now %v", v1.LastAppliedConfigAnnotation, got.Annotations)
	}
	managers := map[string]bool{}
	for _, m := range got.ManagedFields {
		managers[m.Manager] = true
	}
	if !managers["kubectl-client-side-apply"] {
		t.Errorf("the lib's write dropped the server's managedFields: managers now %v", managers)
	}
}
