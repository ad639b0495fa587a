package daemon

import (
	"testing"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snaputils "github.com/kubernetes-csi/external-snapshotter/v8/pkg/utils"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/volume"
)

// The controller's sidecar passes by an unlabelled content of a local snapshot (its node's
// sidecar serves it once labelled), and keeps NFS ones, labelled ones and other drivers'.
func TestHideNodeContents(t *testing.T) {
	local := volume.SnapshotHandle{Backend: volume.BackendLocal, BasePath: "/var/lib/dirpv", Node: "node-a", Name: "snapshot-1"}.String()
	nfs := volume.SnapshotHandle{Backend: volume.BackendNFS, Server: "nfs.example.com", Share: "/srv", BasePath: "/srv", Name: "snapshot-2"}.String()
	content := func(driver, handle string, labels map[string]string) *snapshotv1.VolumeSnapshotContent {
		return &snapshotv1.VolumeSnapshotContent{
			ObjectMeta: metav1.ObjectMeta{Name: "c", Labels: labels},
			Spec:       snapshotv1.VolumeSnapshotContentSpec{Driver: driver, Source: snapshotv1.VolumeSnapshotContentSource{SnapshotHandle: &handle}},
		}
	}
	labelled := map[string]string{snaputils.VolumeSnapshotContentManagedByLabel: "node-a"}
	for _, tc := range []struct {
		name       string
		content    *snapshotv1.VolumeSnapshotContent
		wantDriver string
		wantNode   string
	}{
		{"unlabelled local", content(DriverName, local, nil), "", "node-a"},
		{"labelled local", content(DriverName, local, labelled), DriverName, ""},
		{"nfs", content(DriverName, nfs, nil), DriverName, ""},
		{"other driver", content("other.example.com", local, nil), "other.example.com", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if node := localSnapshotNode(tc.content); node != tc.wantNode {
				t.Errorf("node to label for %q, want %q", node, tc.wantNode)
			}
			obj, err := hideNodeContents(tc.content)
			if err != nil {
				t.Fatal(err)
			}
			if got := obj.(*snapshotv1.VolumeSnapshotContent).Spec.Driver; got != tc.wantDriver {
				t.Errorf("driver seen by the controller's sidecar %q, want %q", got, tc.wantDriver)
			}
		})
	}
}
