package provisioner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snaplisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumesnapshot/v1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/dirpv/dirpv/internal/metricstest"
	"github.com/dirpv/dirpv/volume"
)

// snapshotFixture provisions a local volume holding one file and returns the node's
// Snapshotter over it, running, and the PV.
func snapshotFixture(t *testing.T) (*fixture, *Snapshotter, *v1.PersistentVolume) {
	t.Helper()
	f := newFixture(t)
	pv, _, err := f.node.Provision(context.Background(), opts(f.localClass(nil), claim("src")))
	must(t, err)
	must(t, os.WriteFile(filepath.Join(f.base, pv.Spec.CSI.VolumeAttributes["path"], "data"), []byte("hello"), 0o644))
	return f, startSnapshotter(t, f.node, pv), pv
}

// startSnapshotter starts p's Snapshotter over the PVs, until the test ends.
func startSnapshotter(t *testing.T, p *Provisioner, pvs ...*v1.PersistentVolume) *Snapshotter {
	s := p.Snapshotter(pvLister(pvs...))
	ctx, cancel := context.WithCancel(context.Background())
	wait := s.Start(ctx)
	t.Cleanup(func() {
		cancel()
		wait()
	})
	return s
}

// pvLister lists the PVs.
func pvLister(pvs ...*v1.PersistentVolume) corelisters.PersistentVolumeLister {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	for _, pv := range pvs {
		idx.Add(pv)
	}
	return corelisters.NewPersistentVolumeLister(idx)
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

// A node's snapshot of its local volume, as the sidecar asks for it again and again: the same
// snapshot, ready at once, its copy's job gone; DeleteSnapshot is idempotent; the controller
// cannot see it; one that vanished from the disk is an error, not "not ready". That the snapshot holds the volume's tree, with the source's capacity as its
// restore size, in the base, and that deleting it removes it, test/integration's
// TestLocalSnapshotDeletionPolicy and TestSnapshotRestoreLocal show through the sidecar.
func TestSnapshotLocalVolume(t *testing.T) {
	f, s, pv := snapshotFixture(t)
	id, size := createUntilReady(t, s, "snapshot-1", pv.Spec.CSI.VolumeHandle)
	if s.copying(id) {
		t.Error("the copy's job is still kept after CreateSnapshot reported the snapshot ready")
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
	if ready, _, _, _, err := f.ctrl.Snapshotter(pvLister()).GetSnapshotStatus(context.Background(), id, nil); err == nil {
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
	if _, _, _, _, err := s.GetSnapshotStatus(context.Background(), id, nil); err == nil {
		t.Error("GetSnapshotStatus of a deleted snapshot succeeded")
	}

	// Gone from the disk by other means (an admin's rm, a lost disk) while its content
	// remains: importing its handle reports the error, rather than "not ready" for ever, as
	// if its long finished copy still ran.
	id, _ = createUntilReady(t, s, "snapshot-v", pv.Spec.CSI.VolumeHandle)
	must(t, os.RemoveAll(filepath.Join(f.base, ".dirpv-snapshots", "snapshot-v")))
	if ready, _, _, _, err := s.GetSnapshotStatus(context.Background(), id, nil); err == nil {
		t.Errorf("GetSnapshotStatus of a vanished snapshot: ready %v, no error", ready)
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
	ctrl := f.ctrl.Snapshotter(pvLister())
	if err := ctrl.DeleteSnapshot(context.Background(), foreign, nil); status.Code(err) != codes.InvalidArgument {
		t.Errorf("DeleteSnapshot on an export no class names: %v, want InvalidArgument", err)
	}
	// A local volume's content reaching the controller's sidecar: the cluster's snapshot
	// controller does not label it for its node, and the error says what to change.
	ctrl = f.ctrl.Snapshotter(pvLister(pv))
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

// A snapshot whose copy the base has not the room for is not started: the sidecar gets an
// error saying so, the source's claim an event of its own, nothing is written, and it is not
// tried again, however often the sidecar asks, before its back-off has passed; then, once
// there is room, the copy is made.
func TestSnapshotWithoutRoomBacksOff(t *testing.T) {
	f := newFixtureOn(t, tmpfs(t, "size=12m")) // a base that a few MiB fill
	c := claim("src")
	c.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("1Mi")
	pv, _, err := f.node.Provision(context.Background(), opts(f.localClass(nil), c))
	must(t, err)
	pv.Spec.ClaimRef = &v1.ObjectReference{Namespace: c.Namespace, Name: c.Name, UID: c.UID}
	big := filepath.Join(f.base, pv.Spec.CSI.VolumeAttributes["path"], "big")
	must(t, os.WriteFile(big, make([]byte, 8<<20), 0o644))
	s := startSnapshotter(t, f.node, pv)
	const backoff = 3 * time.Second
	s.noRoomRetryMin, s.noRoomRetryMax = backoff, backoff
	create := func() (bool, error) {
		_, _, _, _, ready, err := s.CreateSnapshot(context.Background(), "snapshot-full", pv.Spec.CSI.VolumeHandle, nil, nil)
		return ready, err
	}
	var refused error
	eventually(t, 30*time.Second, func() (bool, string) {
		_, refused = create()
		return refused != nil, "no error yet"
	})
	refusedAt := time.Now()
	if !errors.Is(refused, volume.ErrNoRoomForCopy) {
		t.Fatalf("CreateSnapshot = %v, want an error saying there is no room for the copy", refused)
	}
	// Other events (the source's size not enforced on tmpfs) come first.
	waitEvent(t, f.events, "Warning "+ReasonNoRoomForCopy+" ", "snapshot-full")
	snapshots := filepath.Join(f.base, ".dirpv-snapshots")
	if names, _ := os.ReadDir(snapshots); len(names) != 0 {
		t.Errorf("the refused snapshot left %v", names)
	}
	// Room now, but within the back-off the sidecar's calls start nothing.
	must(t, os.Truncate(big, 1<<20))
	for time.Since(refusedAt) < backoff/2 {
		if ready, err := create(); ready || !errors.Is(err, volume.ErrNoRoomForCopy) {
			t.Fatalf("CreateSnapshot within the back-off = %v, %v; want the same refusal", ready, err)
		}
		time.Sleep(50 * time.Millisecond) // the sidecar's calls, as often as it would make them
	}
	var ready bool
	eventually(t, 30*time.Second, func() (bool, string) {
		ready, err = create()
		return ready, fmt.Sprintf("not ready: %v", err)
	})
	if d := time.Since(refusedAt); d < backoff {
		t.Errorf("copy made %v after the refusal, back-off %v", d, backoff)
	}
}

// dirpv_snapshot_used_bytes reports a ready snapshot of this instance's contents by its
// VolumeSnapshot and content, with the size its record gives, and nothing for a content not
// ready or of another driver; a process that did not make the snapshot (restarted since) learns
// it after its first scrape. That the series goes with a deleted snapshot, test/integration's
// TestSnapshotCountsInPublishedCapacity shows on a node's /metrics.
func TestSnapshotUsageMetric(t *testing.T) {
	f, s, pv := snapshotFixture(t)
	id, _ := createUntilReady(t, s, "snapshot-1", pv.Spec.CSI.VolumeHandle)
	root, err := volume.OpenRoot(f.base)
	must(t, err)
	defer root.Close()
	info, err := root.SnapshotInfo("snapshot-1")
	if err != nil || info.Size == 0 {
		t.Fatalf("the snapshot's record: %+v, %v; want a size", info, err)
	}
	content := func(name, driver string, ready bool) *snapshotv1.VolumeSnapshotContent {
		return &snapshotv1.VolumeSnapshotContent{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       snapshotv1.VolumeSnapshotContentSpec{Driver: driver, VolumeSnapshotRef: v1.ObjectReference{Namespace: "ns", Name: "vs-" + name}},
			Status:     &snapshotv1.VolumeSnapshotContentStatus{SnapshotHandle: &id, ReadyToUse: &ready},
		}
	}
	contents := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	for _, c := range []*snapshotv1.VolumeSnapshotContent{
		content("snapcontent-1", f.node.cfg.DriverName, true),
		content("snapcontent-2", f.node.cfg.DriverName, false),
		content("snapcontent-3", "other.example.com", true),
	} {
		must(t, contents.Add(c))
	}
	lister := snaplisters.NewVolumeSnapshotContentLister(contents)
	// series returns how many series s reports, and the value of the one of snapcontent-1.
	series := func(s *Snapshotter) (int, float64) {
		t.Helper()
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(s.SnapshotsCollector(func() snaplisters.VolumeSnapshotContentLister { return lister }))
		n, err := testutil.GatherAndCount(reg)
		must(t, err)
		return n, metricstest.Value(t, reg, "dirpv_snapshot_used_bytes",
			map[string]string{"namespace": "ns", "volumesnapshot": "vs-snapcontent-1", "volumesnapshotcontent": "snapcontent-1"})
	}
	if n, v := series(s); n != 1 || v != float64(info.Size) {
		t.Errorf("%d series, snapcontent-1's %v; want only it, at %d", n, v, info.Size)
	}
	restarted := f.node.Snapshotter(s.pvs)
	if n, _ := series(restarted); n != 0 {
		t.Errorf("%d series of a process that has not read the snapshot's record yet, want none", n)
	}
	eventually(t, 30*time.Second, func() (bool, string) {
		n, v := series(restarted)
		return n == 1 && v == float64(info.Size), fmt.Sprintf("after a restart: %d series, snapcontent-1's %v; want only it, at %d", n, v, info.Size)
	})
}
