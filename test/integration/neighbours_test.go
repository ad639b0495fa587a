package integration

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// On kind, rancher.io/local-path's `standard` class stays next to dirpv's: its claims, and a
// PV it made, are none of dirpv's business. dirpv records no event on them, provisions nothing
// for them and deletes nothing of theirs, whether their class is WaitForFirstConsumer or
// Immediate, placed or not, on a node with dirpv's node plugin or without, and whatever
// parameters the class has (ones dirpv would refuse, or ones it would accept).
func TestOtherProvisionersObjectsUntouched(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	const other = "rancher.io/local-path"
	base := filepath.Join(suite.Work.BaseRoot, "neighbours-"+ns)
	must(t, os.MkdirAll(base, 0o755))
	refused := suite.CreateClass(t, "neighbour-wffc", map[string]string{"nodePath": "/opt/local-path-provisioner"}, framework.Provisioner(other))
	lookalike := suite.CreateClass(t, "neighbour-lookalike", map[string]string{"backend": "local", "basePath": base}, framework.Provisioner(other))
	immediate := suite.CreateClass(t, "neighbour-immediate", map[string]string{"backend": "local", "basePath": base}, framework.Provisioner(other), framework.Immediate)
	foreign := map[string]string{
		"unplaced-refused":   refused.Name,
		"unplaced-lookalike": lookalike.Name,
		"on-a-refused":       refused.Name,
		"on-a-lookalike":     lookalike.Name,
		"on-c-lookalike":     lookalike.Name,
		"immediate":          immediate.Name,
	}
	for name, class := range foreign {
		var opts []framework.ClaimOption
		switch {
		case strings.HasPrefix(name, "on-a-"):
			opts = append(opts, framework.OnNode(nodeA))
		case strings.HasPrefix(name, "on-c-"):
			opts = append(opts, framework.OnNode(nodeC))
		}
		suite.CreateClaim(t, ns, name, class, opts...)
	}
	// A Released PV that local-path made on node-a, with reclaim Delete: its directory is in a
	// base that dirpv's node-a instance is allowed.
	dataDir := filepath.Join(base, "pvc-neighbour_"+ns+"_data")
	must(t, os.MkdirAll(dataDir, 0o777))
	must(t, os.WriteFile(filepath.Join(dataDir, "file"), []byte("theirs"), 0o644))
	pv := neighbourPV(ns, dataDir, other)
	created, err := suite.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		suite.Client.CoreV1().PersistentVolumes().Delete(context.Background(), created.Name, metav1.DeleteOptions{})
	})
	// kube-controller-manager releases it (its claim is gone) and leaves the delete to its
	// provisioner: dirpv's lib sees a Released PV due for deletion.
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, created.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return pv.Status.Phase == v1.VolumeReleased, fmt.Errorf("neighbour's PV is %s", pv.Status.Phase)
	})
	must(t, err)

	// Sentinels, made after the neighbours' objects: claims of dirpv's own that get an event
	// from the controller, one after the other, so that by the second event the controller has
	// gone past every neighbour claim at least once. The second is placed on node-c, which runs
	// no dirpv node plugin: the event names the node, and the claim stays Pending with nothing
	// made for it in the base.
	broken := suite.CreateClass(t, "neighbours-sentinel-broken", map[string]string{"backend": "local", "basePath": base, "bsaePath": "/tmp"})
	suite.CreateClaim(t, ns, "sentinel-unplaced", broken.Name)
	waitEvent(t, ns, "PersistentVolumeClaim", "sentinel-unplaced", provisioner.ReasonUnservableClass, "dirpv cannot provision this claim", ctrlProc)
	valid := suite.CreateClass(t, "neighbours-sentinel", map[string]string{"backend": "local", "basePath": base})
	suite.CreateClaim(t, ns, "sentinel-on-c", valid.Name, framework.OnNode(nodeC))
	waitEvent(t, ns, "PersistentVolumeClaim", "sentinel-on-c", provisioner.ReasonNodePluginMissing, "node "+nodeC+" runs no dirpv.io node plugin", ctrlProc)

	evs, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	must(t, err)
	for _, e := range evs.Items {
		if _, theirs := foreign[e.InvolvedObject.Name]; theirs && strings.Contains(e.Source.Component+e.ReportingController, "dirpv") {
			t.Errorf("dirpv (%s) recorded an event on %s's claim %s: %s %q", e.Source.Component, other, e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
	pvEvents, err := suite.Client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{
		FieldSelector: fields.Set{"involvedObject.kind": "PersistentVolume", "involvedObject.name": created.Name}.AsSelector().String()})
	must(t, err)
	for _, e := range pvEvents.Items {
		if strings.Contains(e.Source.Component+e.ReportingController, "dirpv") {
			t.Errorf("dirpv (%s) recorded an event on %s's PV: %s %q", e.Source.Component, other, e.Reason, e.Message)
		}
	}
	for _, name := range append(slices.Collect(maps.Keys(foreign)), "sentinel-on-c") {
		c := getClaim(t, ns, name)
		if c.Status.Phase != v1.ClaimPending || c.Spec.VolumeName != "" {
			t.Errorf("claim %s is %s (volume %q), want Pending with no volume", name, c.Status.Phase, c.Spec.VolumeName)
		}
		if _, ok := c.Labels[provisioner.LabelNode]; ok && name != "sentinel-on-c" {
			t.Errorf("neighbour claim %s got dirpv's label: %v", name, c.Labels)
		}
	}
	if got := entries(t, base); len(got) != 1 || got[0] != filepath.Base(dataDir) {
		t.Errorf("base holds %v, want only the neighbour's %s", got, filepath.Base(dataDir))
	}
	if data, err := os.ReadFile(filepath.Join(dataDir, "file")); err != nil || string(data) != "theirs" {
		t.Errorf("neighbour's data: %q, %v", data, err)
	}
	got, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, created.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("neighbour's PV: %v", err)
	}
	if got.DeletionTimestamp != nil || !slices.Equal(got.Finalizers, []string{"kubernetes.io/pv-protection"}) {
		t.Errorf("neighbour's PV: deletion %v, finalizers %v; want it as kube-controller-manager left it", got.DeletionTimestamp, got.Finalizers)
	}
}

// neighbourPV is a PV as local-path-provisioner makes one for a claim placed on node-a: a
// local volume in dir with node affinity, provisioned-by its name, reclaim Delete, bound to a
// claim that no longer exists.
func neighbourPV(ns, dir, provisionedBy string) *v1.PersistentVolume {
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        fmt.Sprintf("pvc-neighbour-%s", ns),
			Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": provisionedBy, "local.path.provisioner/selected-node": nodeA},
		},
		Spec: v1.PersistentVolumeSpec{
			Capacity:                      v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: v1.PersistentVolumeReclaimDelete,
			StorageClassName:              "neighbour-lookalike",
			ClaimRef:                      &v1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: "gone", UID: "0b7c1d2e-0000-4000-8000-000000000000"},
			PersistentVolumeSource:        v1.PersistentVolumeSource{Local: &v1.LocalVolumeSource{Path: dir}},
			NodeAffinity: &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
				MatchExpressions: []v1.NodeSelectorRequirement{{Key: v1.LabelHostname, Operator: v1.NodeSelectorOpIn, Values: []string{"host-" + nodeA}}},
			}}}},
		},
	}
}
