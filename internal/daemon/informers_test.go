package daemon

import (
	"context"
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// objectMeta is metadata as the API server returns it for an object that kubectl applied and
// controllers then updated: everything the lib and dirpv read, plus what the cache drops.
func objectMeta(name, namespace string) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name: name, Namespace: namespace, UID: types.UID("uid-" + name), ResourceVersion: "42",
		Labels: map[string]string{"app": "db"},
		Annotations: map[string]string{
			"volume.kubernetes.io/storage-provisioner": DriverName,
			"volume.kubernetes.io/selected-node":       "node-1",
			"pv.kubernetes.io/provisioned-by":          DriverName,
			"dirpv.io/on-delete":                       "archive",
			corev1.LastAppliedConfigAnnotation:         `{"apiVersion":"v1","kind":"PersistentVolumeClaim"}`,
		},
		Finalizers: []string{"kubernetes.io/pvc-protection", "external-provisioner.volume.kubernetes.io/finalizer"},
		ManagedFields: []metav1.ManagedFieldsEntry{{
			Manager: "kube-controller-manager", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1",
			FieldsType: "FieldsV1", FieldsV1: metav1.NewFieldsV1(`{"f:metadata":{"f:annotations":{}}}`),
		}},
	}
}

// The informers that the lib and dirpv share cache claims, volumes and classes without
// managedFields and kubectl's last-applied copy, and with everything else the lib and dirpv
// read: labels, the other annotations, finalizers, spec and status; tombstones pass as they are.
func TestInformerCacheDropsOnlyWhatNobodyReads(t *testing.T) {
	block := corev1.PersistentVolumeFilesystem
	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: objectMeta("data", "ns"),
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr.To("dirpv-local"),
			VolumeMode:       &block,
			VolumeName:       "pvc-1",
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
		Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
	}
	volume := &corev1.PersistentVolume{
		ObjectMeta: objectMeta("pvc-1", ""),
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			ClaimRef:                      &corev1.ObjectReference{Namespace: "ns", Name: "data", UID: "uid-data"},
			MountOptions:                  []string{"nfsvers=4.1"},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: DriverName, VolumeHandle: "h", VolumeAttributes: map[string]string{"path": "ns-data"},
			}},
		},
		Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
	}
	class := &storagev1.StorageClass{
		ObjectMeta:  objectMeta("dirpv-local", ""),
		Provisioner: DriverName,
		Parameters:  map[string]string{"backend": "local", "basePath": "/var/lib/dirpv"},
	}

	client := fake.NewClientset(claim, volume, class)
	factory := newInformerFactory(client, 0)
	informers := map[string]cache.SharedIndexInformer{
		"claim":  factory.Core().V1().PersistentVolumeClaims().Informer(),
		"volume": factory.Core().V1().PersistentVolumes().Informer(),
		"class":  factory.Storage().V1().StorageClasses().Informer(),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	factory.Start(ctx.Done())
	defer func() {
		// Shutdown waits for the informers, which stop only with ctx.
		cancel()
		factory.Shutdown()
	}()
	for what, synced := range factory.WaitForCacheSync(ctx.Done()) {
		if !synced {
			t.Fatalf("%v informer never synced", what)
		}
	}

	for what, sent := range map[string]runtime.Object{"claim": claim, "volume": volume, "class": class} {
		key, err := cache.MetaNamespaceKeyFunc(sent)
		must(t, err)
		var cached any
		err = wait.PollUntilContextCancel(ctx, 10*time.Millisecond, true, func(context.Context) (bool, error) {
			var ok bool
			cached, ok, err = informers[what].GetStore().GetByKey(key)
			return ok, err
		})
		if err != nil {
			t.Fatalf("%s %s never reached the cache: %v", what, key, err)
		}
		got := cached.(metav1.Object)
		if len(got.GetManagedFields()) != 0 {
			t.Errorf("cached %s kept managedFields: %v", what, got.GetManagedFields())
		}
		if _, ok := got.GetAnnotations()[corev1.LastAppliedConfigAnnotation]; ok {
			t.Errorf("cached %s kept %s", what, corev1.LastAppliedConfigAnnotation)
		}
		// Everything else must be exactly what the server sent.
		want := sent.DeepCopyObject()
		wm := want.(metav1.Object)
		wm.SetManagedFields(nil)
		delete(wm.GetAnnotations(), corev1.LastAppliedConfigAnnotation)
		if len(wm.GetAnnotations()) == 0 || len(wm.GetLabels()) == 0 || len(wm.GetFinalizers()) == 0 {
			t.Fatalf("test object %s lost the fields it is meant to check", what)
		}
		if !reflect.DeepEqual(cached, want) {
			t.Errorf("cached %s differs from the server's beyond the dropped fields:\n got %+v\nwant %+v", what, cached, want)
		}
	}

	// A tombstone, which the informer hands on for a delete it missed, passes through unchanged
	// and without an error, which would make the informer drop the deletion.
	gone := &corev1.PersistentVolumeClaim{ObjectMeta: objectMeta("data", "ns")}
	got, err := trimObject(cache.DeletedFinalStateUnknown{Key: "ns/data", Obj: gone})
	if err != nil {
		t.Fatalf("trimObject(tombstone): %v", err)
	}
	if tomb, ok := got.(cache.DeletedFinalStateUnknown); !ok || tomb.Key != "ns/data" || tomb.Obj != gone || len(gone.ManagedFields) != 1 {
		t.Errorf("trimObject(tombstone) = %#v; want it unchanged", got)
	}
}
