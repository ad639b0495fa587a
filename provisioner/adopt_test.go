package provisioner

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestBeneath(t *testing.T) {
	for _, tc := range []struct {
		root, dir, rel string
		ok             bool
	}{
		{"/srv/nfs", "/srv/nfs/ns-c-pvc-1", "ns-c-pvc-1", true},
		{"/srv/nfs", "/srv/nfs/ns/c", "ns/c", true},
		{"/srv/nfs", "/srv/nfs", "", false},
		{"/srv/nfs", "/srv/nfs/", "", false},
		{"/srv/nfs", "/srv/nfsx/a", "", false},
		{"/srv/nfs", "/srv/nfs/../etc", "", false},
		{"/srv/nfs", "/srv/nfs/a/./b", "", false},
		{"/srv/nfs", "/srv/nfs//a", "", false},
		{"/srv/nfs", "srv/nfs/a", "", false},
		{"/srv/nfs", "/etc", "", false},
		{"/", "/etc", "", false},
	} {
		rel, ok := beneath(tc.root, tc.dir)
		if rel != tc.rel || ok != tc.ok {
			t.Errorf("beneath(%q, %q) = %q, %t; want %q, %t", tc.root, tc.dir, rel, ok, tc.rel, tc.ok)
		}
	}
}

// An adopted local-path PV: the controller hands it to its node by the hostname its affinity
// names; the node leaves its directory alone while the class is still local-path's, or when
// it is outside the dirpv class's base, and deletes or archives it as the dirpv class that
// replaced local-path's says.
func TestAdoptedLocalPathPV(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	f.node.cfg.Adopt = []string{"rancher.io/local-path"}
	f.ctrl.cfg.Adopt = f.node.cfg.Adopt
	f.classes.Add(&storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "local-path"}, Provisioner: "rancher.io/local-path"})
	dir := filepath.Join(f.base, "pvc-1_ns_c")
	must(t, os.MkdirAll(filepath.Join(dir, "sub"), 0o777))
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", Annotations: map[string]string{AnnProvisionedBy: "rancher.io/local-path"}},
		Spec: v1.PersistentVolumeSpec{
			StorageClassName:              "local-path",
			PersistentVolumeReclaimPolicy: v1.PersistentVolumeReclaimDelete,
			PersistentVolumeSource:        v1.PersistentVolumeSource{HostPath: &v1.HostPathVolumeSource{Path: dir}},
			NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
				MatchExpressions: []v1.NodeSelectorRequirement{{Key: v1.LabelHostname, Operator: v1.NodeSelectorOpIn, Values: []string{"host-a"}}},
			}}}},
		},
		Status: v1.PersistentVolumeStatus{Phase: v1.VolumeReleased},
	}
	if _, err := f.ctrl.cfg.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if f.ctrl.ShouldDelete(ctx, pv) {
		t.Error("the controller would delete an adopted local PV itself")
	}
	placed, err := f.ctrl.cfg.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
	must(t, err)
	if placed.Annotations[AnnNode] != testNode || placed.Labels[LabelNode] != testNode {
		t.Fatalf("adopted PV after the controller saw it: annotations %v labels %v; want it handed to %s (hostname host-a)", placed.Annotations, placed.Labels, testNode)
	}
	if !f.node.ShouldDelete(ctx, placed) {
		t.Fatalf("node %s would not delete the adopted PV handed to it", testNode)
	}

	err = f.node.Delete(ctx, placed)
	if err == nil || !strings.Contains(err.Error(), `"local-path" is still rancher.io/local-path's`) {
		t.Errorf("Delete while the class is local-path's: %v", err)
	}
	f.localClass(nil)
	other := placed.DeepCopy()
	other.Spec.StorageClassName = "local"
	other.Spec.HostPath.Path = filepath.Dir(f.base)
	if err := f.node.Delete(ctx, other); err == nil || !strings.Contains(err.Error(), "is not inside") {
		t.Errorf("Delete of an adopted PV outside the class's base: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "sub")); err != nil {
		t.Fatalf("the directory after the refused Deletes: %v", err)
	}
	placed.Spec.StorageClassName = "local"
	must(t, f.node.Delete(ctx, placed))
	if left := listTree(t, f.base); len(left) != 0 {
		t.Errorf("after Delete (onDelete delete): %v left", left)
	}
}
