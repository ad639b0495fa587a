package provisioner

import (
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/dirpv/dirpv/volume"
)

func TestClaimLabel(t *testing.T) {
	wffc, immediate := storagev1.VolumeBindingWaitForFirstConsumer, storagev1.VolumeBindingImmediate
	local := &storagev1.StorageClass{Provisioner: "dirpv.io", Parameters: map[string]string{ParamBackend: "local"}, VolumeBindingMode: &wffc}
	nfs := &storagev1.StorageClass{Provisioner: "dirpv.io", Parameters: map[string]string{ParamBackend: "nfs"}, VolumeBindingMode: &immediate}
	other := &storagev1.StorageClass{Provisioner: "other.io", Parameters: map[string]string{ParamBackend: "local"}, VolumeBindingMode: &wffc}
	placed := func(node string) map[string]string {
		return map[string]string{annSelectedNode: node, annStorageProvisioner: "dirpv.io"}
	}
	pvOn := func(node string) *v1.PersistentVolume {
		return &v1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "pv", Annotations: map[string]string{AnnNode: node}},
			Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver: "dirpv.io", VolumeAttributes: map[string]string{volume.AttrBackend: "local"}}}},
		}
	}
	for _, tc := range []struct {
		name                string
		class               *storagev1.StorageClass
		labels, annotations map[string]string
		volumeName          string
		pv                  *v1.PersistentVolume
		want                string
	}{
		{name: "not placed", class: local},
		{name: "placed and annotated by kube-controller-manager", class: local, annotations: placed("a"), want: "a"},
		{name: "placed, kube-controller-manager about to annotate it", class: local, annotations: map[string]string{annSelectedNode: "a"}},
		{name: "labelled", class: local, annotations: placed("a"), labels: map[string]string{LabelNode: "a"}},
		{name: "placed elsewhere: relabelled", class: local, annotations: placed("b"), labels: map[string]string{LabelNode: "a"}, want: "b"},
		{name: "handed back to the scheduler: label kept", class: local,
			annotations: map[string]string{annStorageProvisioner: "dirpv.io"}, labels: map[string]string{LabelNode: "a"}},
		{name: "bound: the PV's node", class: local, volumeName: "pv", pv: pvOn("c"), want: "c"},
		{name: "bound, PV unknown: the selected node", class: local, volumeName: "pv", annotations: map[string]string{annSelectedNode: "a"}, want: "a"},
		{name: "nfs", class: nfs, annotations: placed("a")},
		{name: "another provisioner's", class: other, annotations: placed("a")},
		{name: "no class", annotations: placed("a")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			claim := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Labels: tc.labels, Annotations: tc.annotations}}
			claim.Spec.VolumeName = tc.volumeName
			got, ok := ClaimLabel(claim, tc.class, tc.pv, "dirpv.io")
			if got != tc.want || ok != (tc.want != "") {
				t.Errorf("ClaimLabel = %q, %v; want %q", got, ok, tc.want)
			}
		})
	}
}

// Node names run to 253 characters, label values to 63: every long name gets its own value.
func TestNodeLabel(t *testing.T) {
	long := strings.Repeat("n", 100)
	for _, node := range []string{"node-a", strings.Repeat("a", 63), long, long + "x"} {
		v := NodeLabel(node)
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			t.Errorf("NodeLabel(%q) = %q: %v", node, v, errs)
		}
		if len(node) <= 63 && v != node {
			t.Errorf("NodeLabel(%q) = %q, want the name itself", node, v)
		}
	}
	if NodeLabel(long) == NodeLabel(long+"x") {
		t.Errorf("two long names share label value %q", NodeLabel(long))
	}
}
