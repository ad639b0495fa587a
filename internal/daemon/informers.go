package daemon

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/dirpv/dirpv/provisioner"
)

// newInformerFactory returns the one informer factory of a process. dirpv's code and the lib's
// ProvisionController share its informers (the lib would otherwise build private ones), and
// every object is trimmed before it is cached.
func newInformerFactory(client kubernetes.Interface, resync time.Duration) informers.SharedInformerFactory {
	return informers.NewSharedInformerFactoryWithOptions(client, resync, informers.WithTransform(trimObject))
}

// trimObject drops from a cached object what neither dirpv nor the lib reads: managedFields,
// often the largest part of a claim or volume, and kubectl's last-applied-configuration (a
// copy of the whole manifest). Both are safe to drop because almost nothing writes a cached
// object back whole: the lib patches a PV with the diff between its cached copy and that copy
// plus finalizers, and updates a claim from a fresh GET; external-resizer's controller patches
// a claim's status and a PV's capacity with the diff between its cached copy and its change;
// the apiserver keeps its managedFields when an update carries none. The one exception is
// external-provisioner's CloningProtectionController (cloningProtection), which updates a
// claim from its cached copy to remove dirpv's cloning finalizer, and so drops the claim's
// last-applied-configuration. That is harmless: it does so only to a claim being deleted,
// which nothing applies again (kubectl apply creates a new claim once the old one is gone),
// and the update carries the cached resourceVersion, so it never overwrites a newer claim.
// Everything else stays: the lib reads claims' and volumes' annotations, finalizers, spec and
// status, and pathPattern reads claims' labels and annotations. Tombstones are passed on as
// they are. An object with nothing to drop is not written to: client-go's fake clientset
// hands its watchers the very objects it stores when a watch starts behind them, and a write
// there races every read of the fake's store.
func trimObject(obj any) (any, error) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return obj, nil
	}
	if len(m.GetManagedFields()) > 0 {
		m.SetManagedFields(nil)
	}
	// GetAnnotations returns the object's own map.
	if a := m.GetAnnotations(); a[corev1.LastAppliedConfigAnnotation] != "" {
		delete(a, corev1.LastAppliedConfigAnnotation)
	}
	return obj, nil
}

// ownVolumesOnly makes the factory's claim and PV informers, which the lib, the resize
// controller and dirpv share, list and watch only the objects labelled with node
// (provisioner.LabelNode): the API server filters, so a node instance's cache and watch
// traffic grow with its own volumes only. Classes and everything else stay unfiltered. Call it
// before anything asks the factory for those informers: the factory keeps the first informer
// made for a type. Nothing a node instance does needs another node's claim or PV: its
// provisioner, deleter and resizer decline them all.
func ownVolumesOnly(factory informers.SharedInformerFactory, node string) {
	own := func(o *metav1.ListOptions) { o.LabelSelector = provisioner.NodeSelector(node) }
	factory.InformerFor(&corev1.PersistentVolumeClaim{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredPersistentVolumeClaimInformer(c, metav1.NamespaceAll, resync,
			cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, own)
	})
	factory.InformerFor(&corev1.PersistentVolume{}, func(c kubernetes.Interface, resync time.Duration) cache.SharedIndexInformer {
		return coreinformers.NewFilteredPersistentVolumeInformer(c, resync,
			cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, own)
	})
}

// cachedObjects reports how many objects each shared informer of provisioning holds, so that
// one can see (and tests check) that a node instance caches its own claims and PVs only.
func cachedObjects(factory informers.SharedInformerFactory) []prometheus.Collector {
	stores := map[string]cache.SharedIndexInformer{
		"persistentvolumeclaims": factory.Core().V1().PersistentVolumeClaims().Informer(),
		"persistentvolumes":      factory.Core().V1().PersistentVolumes().Informer(),
		"storageclasses":         factory.Storage().V1().StorageClasses().Informer(),
	}
	var cs []prometheus.Collector
	for resource, informer := range stores {
		cs = append(cs, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "dirpv_informer_cached_objects",
			Help:        "Objects in the process's informer cache of the resource.",
			ConstLabels: prometheus.Labels{"resource": resource},
		}, func() float64 { return float64(len(informer.GetStore().ListKeys())) }))
	}
	return cs
}
