package daemon

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
)

// newInformerFactory returns the one informer factory of a process. dirpv's code and the lib's
// ProvisionController share its informers (the lib would otherwise build private ones), and
// every object is trimmed before it is cached.
func newInformerFactory(client kubernetes.Interface, resync time.Duration) informers.SharedInformerFactory {
	return informers.NewSharedInformerFactoryWithOptions(client, resync, informers.WithTransform(trimObject))
}

// trimObject drops from a cached object what neither dirpv nor the lib reads: managedFields,
// often the largest part of a claim or volume, and kubectl's last-applied-configuration (a
// copy of the whole manifest). Both are safe to drop only because nothing writes a cached
// object back whole: the lib patches a PV with the diff between its cached copy and that copy
// plus finalizers, and updates a claim from a fresh GET; external-resizer's controller patches
// a claim's status and a PV's capacity with the diff between its cached copy and its change;
// the apiserver keeps its managedFields when an update carries none. Everything else stays: the lib reads claims' and volumes'
// annotations, finalizers, spec and status, and pathPattern reads claims' labels and
// annotations. Tombstones are passed on as they are.
func trimObject(obj any) (any, error) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return obj, nil
	}
	m.SetManagedFields(nil)
	// GetAnnotations returns the object's own map (deleting from a nil one is a no-op).
	delete(m.GetAnnotations(), corev1.LastAppliedConfigAnnotation)
	return obj, nil
}
