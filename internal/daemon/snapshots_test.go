package daemon

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snaputils "github.com/kubernetes-csi/external-snapshotter/v8/pkg/utils"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	fakediscovery "k8s.io/client-go/discovery/fake"
	clienttesting "k8s.io/client-go/testing"

	"github.com/dirpv/dirpv/volume"
)

// A cluster without the snapshot CRDs is asked less and less often, down to once in 10
// minutes (and a bit), not every 30 s for ever: a day costs each node a few hundred
// discovery requests at most instead of 2880.
func TestSnapshotAPIBackoff(t *testing.T) {
	next := snapshotAPIBackoff.DelayFunc()
	want := 30 * time.Second
	var elapsed time.Duration
	calls := 0
	for elapsed < 24*time.Hour {
		d := next()
		if d < want || d > want+want/10 {
			t.Fatalf("wait #%d is %v, want %v plus at most 10%%", calls+1, d, want)
		}
		want = min(2*want, 10*time.Minute)
		elapsed += d
		calls++
	}
	if calls > 24*6+10 {
		t.Errorf("%d discovery requests a day, want at most one every 10 minutes", calls)
	}
}

// Once the CRDs are installed, the wait ends without a restart.
func TestWaitForSnapshotAPIFindsLateCRDs(t *testing.T) {
	orig := snapshotAPIBackoff
	snapshotAPIBackoff = wait.Backoff{Duration: time.Millisecond, Factor: 2, Steps: 5, Cap: 10 * time.Millisecond}
	t.Cleanup(func() { snapshotAPIBackoff = orig })
	fake := &clienttesting.Fake{}
	var asked atomic.Int32
	fake.AddReactor("get", "resource", func(clienttesting.Action) (bool, runtime.Object, error) {
		if asked.Add(1) == 3 {
			// Invokes holds fake's lock while it calls reactors.
			fake.Resources = []*metav1.APIResourceList{{
				GroupVersion: snapshotv1.SchemeGroupVersion.String(),
				APIResources: []metav1.APIResource{{Name: "volumesnapshots"}, {Name: "volumesnapshotcontents"}, {Name: "volumesnapshotclasses"}},
			}}
		}
		return false, nil, nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if !waitForSnapshotAPI(ctx, &fakediscovery.FakeDiscovery{Fake: fake}) {
		t.Fatalf("the CRDs were never found (%d looks)", asked.Load())
	}
}

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
			must(t, err)
			if got := obj.(*snapshotv1.VolumeSnapshotContent).Spec.Driver; got != tc.wantDriver {
				t.Errorf("driver seen by the controller's sidecar %q, want %q", got, tc.wantDriver)
			}
		})
	}
}
