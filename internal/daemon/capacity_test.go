package daemon

import (
	"context"
	"strings"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/provisioner"
)

// Every node gets a managed-by label value of its own that the API accepts, however long its
// name (node names may have 253 characters, label values 63).
func TestNodeManagedBy(t *testing.T) {
	long := strings.Repeat("n", 240)
	seen := map[string]string{}
	for _, node := range []string{"node-a", long + "-1", long + "-2", strings.Repeat("a.", 120) + "b"} {
		v := nodeManagedBy(node)
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			t.Errorf("nodeManagedBy(%.20s...) = %q: %v", node, v, errs)
		}
		if other, dup := seen[v]; dup {
			t.Errorf("nodes %.20s... and %.20s... share %q", node, other, v)
		}
		seen[v] = node
	}
	if got := nodeManagedBy("node-a"); got != "dirpv.io-node-node-a" {
		t.Errorf("nodeManagedBy(node-a) = %q", got)
	}
}

// The capacity controller sees only the classes its instance publishes.
func TestFilteredClasses(t *testing.T) {
	keep, drop := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "keep"}}, &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "drop"}}
	factory := informers.NewSharedInformerFactory(fake.NewClientset(), 0)
	inf := factory.Storage().V1().StorageClasses()
	for _, c := range []*storagev1.StorageClass{keep, drop} {
		must(t, inf.Informer().GetIndexer().Add(c))
	}
	f := filteredClasses{inf, func(c *storagev1.StorageClass) bool { return c.Name == "keep" }}
	all, err := f.Lister().List(labels.Everything())
	if err != nil || len(all) != 1 || all[0].Name != "keep" {
		t.Errorf("List = %v, %v; want only keep", all, err)
	}
	if _, err := f.Lister().Get("drop"); !apierrors.IsNotFound(err) {
		t.Errorf("Get(drop) = %v, want NotFound", err)
	}
	if c, err := f.Lister().Get("keep"); err != nil || c.Name != "keep" {
		t.Errorf("Get(keep) = %v, %v", c, err)
	}
}

// A pod owns only objects of its own namespace: published elsewhere, they get no owner rather
// than one the garbage collector would delete them for at once.
func TestPodOwnerOnlyInItsNamespace(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		cfg  CapacityConfig
		want bool
	}{
		{CapacityConfig{PodName: "p", PodUID: "u", PodNamespace: "dirpv", Namespace: "dirpv"}, true},
		{CapacityConfig{PodName: "p", PodUID: "u", PodNamespace: "dirpv", Namespace: "elsewhere"}, false},
		{CapacityConfig{Namespace: "dirpv"}, false},
	} {
		ref, err := podOwner(ctx, tc.cfg)(ctx)
		if err != nil || (ref != nil) != tc.want {
			t.Errorf("podOwner(%+v) = %v, %v; want an owner: %v", tc.cfg, ref, err, tc.want)
		}
	}
}

// A publisher whose owner is missing for longer than its back-off takes to reach its cap (a
// controller that starts before its CSIDriver exists) keeps trying, and publishes once the
// owner is there.
func TestCapacityPublisherWaitsForItsOwner(t *testing.T) {
	p, err := provisioner.New(provisioner.Config{DriverName: DriverName, Role: provisioner.RoleController, Client: fake.NewClientset(),
		Classes: informers.NewSharedInformerFactory(fake.NewClientset(), 0).Storage().V1().StorageClasses().Lister(),
		WorkDir: t.TempDir(), Mounter: mount.NewFakeMounter(nil)})
	must(t, err)
	missing := 20
	owner := &metav1.OwnerReference{Kind: "CSIDriver", Name: DriverName, UID: types.UID("uid-1")}
	c := &capacityPublisher{p: p, timeout: time.Second, retryFirst: time.Millisecond, retryMax: 4 * time.Millisecond,
		owner: func(context.Context) (*metav1.OwnerReference, error) {
			if missing > 0 {
				missing--
				return nil, apierrors.NewNotFound(storagev1.Resource("csidrivers"), DriverName)
			}
			return owner, nil
		}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got, _, ok := c.ready(ctx)
	if !ok || got != owner {
		t.Errorf("ready = %v, %t after the owner was missing for 20 lookups; want the owner (%d lookups left missing)", got, ok, missing)
	}
}
