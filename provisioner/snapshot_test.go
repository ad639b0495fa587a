package provisioner

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/dirpv/dirpv/volume"
)

// snapshotFixture provisions a local volume holding one file and returns the node's
// Snapshotter over it, running, and the PV.
func snapshotFixture(t *testing.T) (*fixture, *Snapshotter, *v1.PersistentVolume) {
	t.Helper()
	f := newFixture(t)
	pv, _, err := f.node.Provision(context.Background(), opts(f.localClass(nil), claim("src")))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.base, pv.Spec.CSI.VolumeAttributes["path"], "data"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	pvs := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	pvs.Add(pv)
	s := f.node.Snapshotter(corelisters.NewPersistentVolumeLister(pvs))
	ctx, cancel := context.WithCancel(context.Background())
	wait := s.Start(ctx)
	t.Cleanup(func() {
		cancel()
		wait()
	})
	return f, s, pv
}

// createUntilReady calls CreateSnapshot as the sidecar does, again until it says ready.
func createUntilReady(t *testing.T, s *Snapshotter, name, handle string) (string, int64) {
	t.Helper()
	var id string
	var size int64
	// The sidecar's requeue, much shortened.
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, i, created, sz, ready, err := s.CreateSnapshot(ctx, name, handle, nil, nil)
		if err != nil || !ready {
			return false, err
		}
		if created.IsZero() {
			t.Error("ready snapshot without a creation time")
		}
		id, size = i, sz
		return true, nil
	})
	if err != nil {
		t.Fatalf("snapshot not ready: %v", err)
	}
	return id, size
}

// A node's snapshot of its local volume: ready once the copy is complete, with the source's
// capacity as its size and a handle naming the node and base; the copy holds the volume's
// files; DeleteSnapshot removes it and is idempotent.
func TestSnapshotLocalVolume(t *testing.T) {
	f, s, pv := snapshotFixture(t)
	id, size := createUntilReady(t, s, "snapshot-1", pv.Spec.CSI.VolumeHandle)
	if want := pv.Spec.Capacity.Storage().Value(); size != want {
		t.Errorf("size %d, want the PV's capacity %d", size, want)
	}
	h, err := volume.ParseSnapshotHandle(id)
	if err != nil {
		t.Fatal(err)
	}
	if h.Backend != volume.BackendLocal || h.Node != testNode || h.BasePath != f.base || h.Name != "snapshot-1" {
		t.Errorf("handle %+v", h)
	}
	if s.copying(id) {
		t.Error("the copy's job is still kept after CreateSnapshot reported the snapshot ready")
	}
	tree := filepath.Join(f.base, ".dirpv-snapshots", "snapshot-1", "tree")
	if b, err := os.ReadFile(filepath.Join(tree, "data")); err != nil || string(b) != "hello" {
		t.Errorf("snapshot's copy of data: %q %v", b, err)
	}
	// Called again (a retry, a restart): the same snapshot, ready at once.
	if _, id2, _, _, ready, err := s.CreateSnapshot(context.Background(), "snapshot-1", pv.Spec.CSI.VolumeHandle, nil, nil); err != nil || !ready || id2 != id {
		t.Errorf("second CreateSnapshot: ready %v id %q err %v", ready, id2, err)
	}
	if ready, _, sz, _, err := s.GetSnapshotStatus(context.Background(), id, nil); err != nil || !ready || sz != size {
		t.Errorf("GetSnapshotStatus: ready %v size %d err %v", ready, sz, err)
	}
	// The controller cannot see a node's disk (its sidecar is not given local contents:
	// internal/daemon hideNodeContents).
	pvs := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	if ready, _, _, _, err := f.ctrl.Snapshotter(corelisters.NewPersistentVolumeLister(pvs)).GetSnapshotStatus(context.Background(), id, nil); err == nil {
		t.Errorf("controller's GetSnapshotStatus of a local snapshot: ready %v, no error", ready)
	}
	// Its copy is over: whether it is still there is the disk's to say, not the copy's.
	if s.copying(id) {
		t.Error("a complete snapshot's copy still counts as running")
	}
	for i := 0; i < 2; i++ {
		if err := s.DeleteSnapshot(context.Background(), id, nil); err != nil {
			t.Fatalf("DeleteSnapshot #%d: %v", i+1, err)
		}
	}
	if _, err := os.Lstat(filepath.Join(f.base, ".dirpv-snapshots", "snapshot-1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("snapshot directory after DeleteSnapshot: %v", err)
	}
	if _, _, _, _, err := s.GetSnapshotStatus(context.Background(), id, nil); err == nil {
		t.Error("GetSnapshotStatus of a deleted snapshot succeeded")
	}
}

// What the sidecar may pass that dirpv must refuse, with nothing made on disk.
func TestSnapshotRefusals(t *testing.T) {
	f, s, pv := snapshotFixture(t)
	before := listTree(t, f.base)
	_, _, _, _, _, err := s.CreateSnapshot(context.Background(), "snapshot-p", pv.Spec.CSI.VolumeHandle, map[string]string{"speed": "fast"}, nil)
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("class parameters: %v, want InvalidArgument", err)
	}
	for _, handle := range []string{"local:no-such-pv", "nonsense", "nfs:" + pv.Name} {
		if _, _, _, _, _, err := s.CreateSnapshot(context.Background(), "snapshot-h", handle, nil, nil); err == nil {
			t.Errorf("volume handle %q accepted", handle)
		}
	}
	other := volume.SnapshotHandle{Backend: volume.BackendLocal, BasePath: f.base, Node: "node-b", Name: "x"}.String()
	if err := s.DeleteSnapshot(context.Background(), other, nil); err == nil {
		t.Error("DeleteSnapshot of another node's snapshot accepted")
	}
	if err := s.DeleteSnapshot(context.Background(), "nfs:pv", nil); status.Code(err) != codes.InvalidArgument {
		t.Errorf("DeleteSnapshot of a handle not dirpv's: %v", err)
	}
	// A handle naming an export no class names (a pre-provisioned content's): the controller
	// refuses it without mounting anything.
	foreign := volume.SnapshotHandle{Backend: volume.BackendNFS, Server: "evil.example.com", Share: "/srv", Name: "x"}.String()
	ctrl := f.ctrl.Snapshotter(corelisters.NewPersistentVolumeLister(cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})))
	if err := ctrl.DeleteSnapshot(context.Background(), foreign, nil); status.Code(err) != codes.InvalidArgument {
		t.Errorf("DeleteSnapshot on an export no class names: %v, want InvalidArgument", err)
	}
	// A local volume's content reaching the controller's sidecar: the cluster's snapshot
	// controller does not label it for its node, and the error says what to change.
	pvs := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	pvs.Add(pv)
	ctrl = f.ctrl.Snapshotter(corelisters.NewPersistentVolumeLister(pvs))
	if _, _, _, _, _, err := ctrl.CreateSnapshot(context.Background(), "snapshot-c", pv.Spec.CSI.VolumeHandle, nil, nil); err == nil || !strings.Contains(err.Error(), "--enable-distributed-snapshotting") {
		t.Errorf("controller's CreateSnapshot of a local volume: %v, want it to name --enable-distributed-snapshotting", err)
	}
	if mps, _ := f.mounter.List(); len(mps) != 0 {
		t.Errorf("mounted %v for a foreign handle", mps)
	}
	if got := listTree(t, f.base); len(got) != len(before) {
		t.Errorf("refusals changed the base:\n before %v\n after  %v", before, got)
	}
}

// A snapshot gone from the disk by other means than DeleteSnapshot (an admin's rm, a lost
// disk) while its content remains: importing its handle reports the error, rather than
// "not ready" for ever, as if its long finished copy still ran.
func TestSnapshotStatusOfVanishedSnapshot(t *testing.T) {
	f, s, pv := snapshotFixture(t)
	id, _ := createUntilReady(t, s, "snapshot-v", pv.Spec.CSI.VolumeHandle)
	if err := os.RemoveAll(filepath.Join(f.base, ".dirpv-snapshots", "snapshot-v")); err != nil {
		t.Fatal(err)
	}
	ready, _, _, _, err := s.GetSnapshotStatus(context.Background(), id, nil)
	if err == nil {
		t.Fatalf("GetSnapshotStatus of a vanished snapshot: ready %v, no error", ready)
	}
	t.Logf("GetSnapshotStatus: %v", err)
}
