package provisioner

import (
	"maps"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/dirpv/dirpv/volume"
)

func TestClaimRouting(t *testing.T) {
	wffc, immediate := storagev1.VolumeBindingWaitForFirstConsumer, storagev1.VolumeBindingImmediate
	local := &storagev1.StorageClass{Provisioner: "dirpv.io", Parameters: map[string]string{ParamBackend: "local"}, VolumeBindingMode: &wffc}
	nfs := &storagev1.StorageClass{Provisioner: "dirpv.io", Parameters: map[string]string{ParamBackend: "nfs"}, VolumeBindingMode: &immediate}
	other := &storagev1.StorageClass{Provisioner: "other.io", Parameters: map[string]string{ParamBackend: "local"}, VolumeBindingMode: &wffc}
	provisioned := map[string]string{annStorageProvisioner: "dirpv.io", annBetaStorageProvisioner: "dirpv.io"}
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
		wantLabels, wantAnn map[string]string
	}{
		{name: "new claim: annotated before kube-controller-manager would", class: local, wantAnn: provisioned},
		{name: "annotated already", class: local, annotations: provisioned},
		{name: "placed and annotated: labelled", class: local,
			annotations: map[string]string{annSelectedNode: "a", annStorageProvisioner: "dirpv.io"}, wantLabels: map[string]string{LabelNode: "a"}},
		{name: "placed, not annotated: kube-controller-manager is about to update it", class: local,
			annotations: map[string]string{annSelectedNode: "a"}},
		{name: "placed and labelled", class: local, annotations: map[string]string{annSelectedNode: "a", annStorageProvisioner: "dirpv.io"},
			labels: map[string]string{LabelNode: "a"}},
		{name: "placed elsewhere: relabelled", class: local, annotations: map[string]string{annSelectedNode: "b", annStorageProvisioner: "dirpv.io"},
			labels: map[string]string{LabelNode: "a"}, wantLabels: map[string]string{LabelNode: "b"}},
		{name: "handed back to the scheduler: label kept", class: local, annotations: provisioned, labels: map[string]string{LabelNode: "a"}},
		{name: "bound: the PV's node", class: local, volumeName: "pv", pv: pvOn("c"), wantLabels: map[string]string{LabelNode: "c"}},
		{name: "bound, PV unknown: the selected node", class: local, volumeName: "pv",
			annotations: map[string]string{annSelectedNode: "a"}, wantLabels: map[string]string{LabelNode: "a"}},
		{name: "nfs: left to kube-controller-manager", class: nfs},
		{name: "another provisioner's", class: other, annotations: map[string]string{annSelectedNode: "a", annStorageProvisioner: "other.io"}},
		{name: "no class", annotations: map[string]string{annSelectedNode: "a", annStorageProvisioner: "dirpv.io"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			claim := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Labels: tc.labels, Annotations: tc.annotations}}
			claim.Spec.VolumeName = tc.volumeName
			labels, ann := ClaimRouting(claim, tc.class, tc.pv, "dirpv.io")
			if !maps.Equal(labels, tc.wantLabels) || !maps.Equal(ann, tc.wantAnn) {
				t.Errorf("labels %v annotations %v, want %v %v", labels, ann, tc.wantLabels, tc.wantAnn)
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
