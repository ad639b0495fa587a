package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// btrfsCopyBase is a copyBase on a btrfs file system with quota on, whose source volume is
// limited (a subvolume).
func btrfsCopyBase(t *testing.T) (*copyBase, quota.ID) {
	t.Helper()
	mnt := quotatest.Btrfs(t, true)
	b := &copyBase{base: mnt, outside: filepath.Join(t.TempDir(), "outside")}
	must(t, os.WriteFile(b.outside, []byte("secret"), 0o600))
	r := rootAt(t, mnt)
	b.root = r
	_, id, err := r.MkdirAllLimited("ns/src", Owner{Mode: 0o2750, UID: 1000, GID: 2000}, Claim{UID: "src-uid"}, 64<<20)
	must(t, err)
	writeEveryKind(t, filepath.Join(mnt, "ns/src"), b.outside)
	return b, id
}

// limitOf reads the limit and ID of the volume rel from its marker.
func limitOf(t *testing.T, r *Root, rel string) (quota.ID, quota.Usage) {
	t.Helper()
	f, err := os.Open(filepath.Join(r.Path(), rel))
	must(t, err)
	defer f.Close()
	id, ok, err := VolumeQuota(int(f.Fd()))
	if err != nil || !ok {
		t.Fatalf("%s: no quota in its marker (%v)", rel, err)
	}
	fs, err := r.Quota()
	must(t, err)
	u, err := fs.Usage(int(f.Fd()), id)
	must(t, err)
	return id, u
}

// TestBtrfsSnapshots: a limited clone of a limited volume on btrfs is a snapshot of it, with a
// qgroup and limit of its own and the new claim's marker, whose removal takes its qgroup along.
// A snapshot of the volume is a read-only btrfs snapshot, point in time; restoring it makes a
// writable volume with its own limit; deleting it removes it and its qgroup. A source bigger
// than the clone's limit is refused and leaves nothing.
func TestBtrfsSnapshots(t *testing.T) {
	b, srcID := btrfsCopyBase(t)
	src := filepath.Join(b.base, "ns/src")
	// A clone or a restored snapshot is the source as it is but for its device nodes, left out
	// as a copy leaves them out.
	want := expectedCopy(t, src)
	ctx := context.Background()
	groups := len(quotatest.Qgroups(t, b.base))
	check := func(what, rel string, stats CopyStats, id quota.ID, limit uint64) {
		t.Helper()
		if stats.Method != MethodBtrfsSnapshot || stats.SkippedDevices != 1 {
			t.Errorf("%s: Method %q, %d device nodes left out; want %q, 1", what, stats.Method, stats.SkippedDevices, MethodBtrfsSnapshot)
		}
		if id.Kind != quota.Btrfs || id == srcID {
			t.Errorf("%s's quota %v, want a btrfs qgroup of its own (the source's is %v)", what, id, srcID)
		}
		if marked, u := limitOf(t, b.root, rel); marked != id || u.LimitBytes != limit {
			t.Errorf("%s's marker names %v with limit %d, want %v limited to %d", what, marked, u.LimitBytes, id, limit)
		}
		diffTrees(t, want, treeHash(t, filepath.Join(b.base, rel)))
	}
	claim := Claim{UID: "clone-uid", PVName: "pv-clone"}
	created, id, stats, err := b.root.MkdirAllFrom(ctx, "ns/clone", claim, 32<<20, Source{Root: b.root, Rel: "ns/src"})
	if err != nil || !created {
		t.Fatalf("MkdirAllFrom = %v, %v", created, err)
	}
	check("clone", "ns/clone", stats, id, 32<<20)
	if owner, _, err := b.root.VolumeOwner("ns/clone"); err != nil || owner != claim {
		t.Errorf("clone's owner %+v, %v; want %+v", owner, err, claim)
	}
	if _, u := limitOf(t, b.root, "ns/src"); u.LimitBytes != 64<<20 {
		t.Errorf("source's limit is now %d, want 64 MiB", u.LimitBytes)
	}
	if err := b.root.RemoveLimited("ns/clone", id); err != nil {
		t.Fatalf("RemoveLimited of the clone: %v", err)
	}
	if after := quotatest.Qgroups(t, b.base); len(after) != groups || after[fmt.Sprintf("0/%d", id.Num)] != "" {
		t.Errorf("qgroups %v after the clone's removal, want %d without 0/%d", after, groups, id.Num)
	}

	info, err := b.root.Snapshot(ctx, "ns/src", "snap", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Method != MethodBtrfsSnapshot || info.Size < 8<<10 {
		t.Errorf("SnapshotInfo %+v, want a btrfs snapshot of at least 8 KiB", info)
	}
	tree := filepath.Join(b.base, snapshotsDir, "snap", snapshotTree)
	if err := os.WriteFile(filepath.Join(tree, "new"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("writing into the snapshot: %v, want EROFS", err)
	}
	if err := os.Remove(filepath.Join(tree, "empty")); !errors.Is(err, unix.EROFS) {
		t.Errorf("removing from the snapshot: %v, want EROFS", err)
	}
	must(t, os.WriteFile(filepath.Join(src, "later"), []byte("after"), 0o644))
	if again, err := b.root.Snapshot(ctx, "ns/src", "snap", SnapshotOptions{}); err != nil || again != info {
		t.Errorf("second Snapshot = %+v, %v; want %+v", again, err, info)
	}
	_, id, stats, err = b.root.MkdirAllFrom(ctx, "ns/restored", Claim{UID: "restored"}, 16<<20, b.root.SnapshotSource("snap"))
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	check("restored volume", "ns/restored", stats, id, 16<<20)
	must(t, os.WriteFile(filepath.Join(b.base, "ns/restored/writable"), nil, 0o644))
	if err := b.root.DeleteSnapshot("snap"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.root.SnapshotInfo("snap"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("SnapshotInfo after DeleteSnapshot: %v, want ErrNotExist", err)
	}
	// The source's, the restored volume's; the snapshot's is gone.
	if got := len(quotatest.Qgroups(t, b.base)); got != groups+1 {
		t.Errorf("%d qgroups after the delete, want %d", got, groups+1)
	}

	data := make([]byte, 8<<20)
	for i := range data {
		data[i] = byte(i*7 + i>>9)
	}
	must(t, os.WriteFile(filepath.Join(src, "big"), data, 0o644))
	_, _, _, err = b.root.MkdirAllFrom(ctx, "ns/small", Claim{UID: "small"}, 4<<20, Source{Root: b.root, Rel: "ns/src"})
	if !errors.Is(err, unix.EDQUOT) {
		t.Fatalf("clone of more than 8 MiB into 4 MiB: %v, want EDQUOT", err)
	}
	absent(t, filepath.Join(b.base, "ns/small"), "a volume was made")
	noTemp(t, filepath.Join(b.base, "ns"))
	if got := len(quotatest.Qgroups(t, b.base)); got != groups+1 {
		t.Errorf("%d qgroups after the refused clone, want %d", got, groups+1)
	}
}

// TestBtrfsNestedSubvolumesAreCopied: a subvolume a pod made inside its volume is no empty
// directory in a clone or a snapshot of the volume: the source is walked instead of snapshot.
func TestBtrfsNestedSubvolumesAreCopied(t *testing.T) {
	b, _ := btrfsCopyBase(t)
	nested := filepath.Join(b.base, "ns/src/a/nested")
	if out, err := exec.Command("btrfs", "subvolume", "create", nested).CombinedOutput(); err != nil {
		t.Fatalf("btrfs subvolume create: %v: %s", err, out)
	}
	must(t, os.WriteFile(filepath.Join(nested, "file"), []byte("in a nested subvolume"), 0o644))
	ctx := context.Background()
	check := func(what, method, tree string) {
		t.Helper()
		if method == MethodBtrfsSnapshot {
			t.Errorf("%s: Method %q, want a walk (a snapshot leaves nested subvolumes empty)", what, method)
		}
		if got, err := os.ReadFile(filepath.Join(tree, "a/nested/file")); string(got) != "in a nested subvolume" {
			t.Errorf("%s: the nested subvolume's file holds %q (%v), want its data", what, got, err)
		}
	}
	_, _, stats, err := b.root.MkdirAllFrom(ctx, "ns/clone", Claim{UID: "clone"}, 32<<20, Source{Root: b.root, Rel: "ns/src"})
	if err != nil {
		t.Fatalf("clone: %v", err)
	}
	check("clone", stats.Method, filepath.Join(b.base, "ns/clone"))
	info, err := b.root.Snapshot(ctx, "ns/src", "snap", SnapshotOptions{})
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	check("snapshot", info.Method, filepath.Join(b.base, snapshotsDir, "snap", snapshotTree))
}

// TestMkdirAllFromReflinkOnBtrfs: a copy of a plain directory on btrfs clones every file
// (reflink), into a plain directory and into a limited subvolume. Sharing its source's data,
// it needs no room for it, however big the source: no room is checked.
func TestMkdirAllFromReflinkOnBtrfs(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	mkVolume(t, r, "ns/src", Owner{Mode: 0o755, UID: 1, GID: 2}, Claim{UID: "src"})
	outside := filepath.Join(t.TempDir(), "outside")
	writeEveryKind(t, filepath.Join(mnt, "ns/src"), outside)
	must(t, os.WriteFile(filepath.Join(mnt, "ns/src/big"), make([]byte, 8<<20), 0o644))
	want := expectedCopy(t, filepath.Join(mnt, "ns/src"))
	free, err := r.Available()
	must(t, err)
	if err := r.CheckRoomForCopy(context.Background(), Source{Root: r, Rel: "ns/src"}, free); err != nil {
		t.Errorf("room for a reflink copy on btrfs, with a margin of all the free space: %v, want no check", err)
	}
	for _, limit := range []uint64{0, 64 << 20} {
		name := "ns/copy0"
		if limit > 0 {
			name = "ns/copy-limited"
		}
		_, _, stats, err := r.MkdirAllFrom(context.Background(), name, Claim{UID: name}, limit, Source{Root: r, Rel: "ns/src"})
		if err != nil {
			t.Fatalf("copy with limit %d: %v", limit, err)
		}
		if stats.Method != MethodReflink {
			t.Errorf("copy with limit %d: Method %q, want %q", limit, stats.Method, MethodReflink)
		}
		diffTrees(t, want, treeHash(t, filepath.Join(mnt, name)))
	}
}

// TestSnapshotCopy: where no btrfs snapshot can be made, a snapshot is a copy of the volume
// as it was, kept under the reserved name; it is restored by MkdirAllFrom, and deleted without
// a trace. (That it is idempotent, and so is its delete: provisioner TestSnapshotLocalVolume.)
func TestSnapshotCopy(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	src := filepath.Join(b.base, "ns/src")
	want := expectedCopy(t, src)
	start := time.Now().Add(-time.Second)
	ctx := context.Background()
	info, err := b.root.Snapshot(ctx, "ns/src", "snap-1", SnapshotOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Name != "snap-1" || info.Method != MethodCopy || info.Size < 8<<10 || info.CreatedAt.Before(start.Truncate(time.Second)) {
		t.Errorf("SnapshotInfo %+v, want snap-1, copied, at least 8 KiB, made now", info)
	}
	must(t, os.WriteFile(filepath.Join(src, "later"), []byte("after the snapshot"), 0o644))
	must(t, os.Remove(filepath.Join(src, "a/b/c/file")))

	if got, err := b.root.SnapshotInfo("snap-1"); err != nil || got != info {
		t.Errorf("SnapshotInfo = %+v, %v; want %+v", got, err, info)
	}
	if _, err := b.root.Snapshot(ctx, "ns/other", "snap-1", SnapshotOptions{}); err == nil {
		t.Error("a snapshot of another volume under the same name: no error")
	}
	for _, bad := range []string{"", ".", "..", "a/b", ReservedPrefix + "x"} {
		if _, err := b.root.Snapshot(ctx, "ns/src", bad, SnapshotOptions{}); err == nil {
			t.Errorf("snapshot named %q: no error", bad)
		}
	}
	if _, err := b.root.MkdirAll(snapshotsDir+"/snap-1", Owner{Mode: 0o755}, Claim{UID: "x"}); !errors.Is(err, ErrReservedName) {
		t.Errorf("MkdirAll into the snapshots: %v, want ErrReservedName", err)
	}

	_, _, _, err = b.root.MkdirAllFrom(ctx, "ns/restored", Claim{UID: "restored"}, 0, b.root.SnapshotSource("snap-1"))
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	delete(want, "null") // the snapshot keeps it, a volume restored from it does not
	diffTrees(t, want, treeHash(t, filepath.Join(b.base, "ns/restored")))

	if err := b.root.DeleteSnapshot("snap-1"); err != nil {
		t.Fatal(err)
	}
	if n, err := os.ReadDir(filepath.Join(b.base, snapshotsDir)); err != nil || len(n) != 0 {
		t.Errorf("snapshots directory after the delete holds %v (%v), want nothing", n, err)
	}
	if got, _ := os.ReadFile(filepath.Join(b.base, "ns/restored/a/b/c/file")); string(got) != "hello" {
		t.Errorf("restored volume lost its file with the snapshot: %q", got)
	}
}

// TestMoveSnapshot: a snapshot moved away for a removal elsewhere (an NFS export's trash)
// leaves its name at once, gets the same entry on every attempt, so a retry finds it moved,
// and takes with it what a DeleteSnapshot cut short left under its private name and a copy
// left unfinished.
func TestMoveSnapshot(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	ctx := context.Background()
	if _, err := b.root.Snapshot(ctx, "ns/src", "s", SnapshotOptions{}); err != nil {
		t.Fatal(err)
	}
	entries, moved, err := b.root.MoveSnapshot("s", "trash")
	if err != nil || !moved || len(entries) != 1 {
		t.Fatalf("MoveSnapshot = %q, %v, %v; want one entry, moved", entries, moved, err)
	}
	if _, err := b.root.SnapshotInfo("s"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("SnapshotInfo after the move: %v, want ErrNotExist", err)
	}
	diffTrees(t, expectedCopy(t, filepath.Join(b.base, "ns/src")), treeHash(t, filepath.Join(b.base, "trash", entries[0], snapshotTree)))
	if again, moved, err := b.root.MoveSnapshot("s", "trash"); err != nil || moved || len(again) != 1 || again[0] != entries[0] {
		t.Errorf("MoveSnapshot again = %q, %v, %v; want %q, not moved", again, moved, err, entries)
	}
	if none, moved, err := b.root.MoveSnapshot("never", "trash"); err != nil || moved || len(none) != 0 {
		t.Errorf("MoveSnapshot of a missing snapshot = %q, %v, %v; want nothing", none, moved, err)
	}

	// A local-style delete cut short renamed the snapshot to its private name; a copy was
	// stopped half-way and kept (KeepFailed).
	snaps := filepath.Join(b.base, snapshotsDir)
	must(t, os.MkdirAll(filepath.Join(snaps, snapshotGonePrefix+nameHash("cut"), snapshotTree, "half"), 0o755))
	must(t, os.MkdirAll(filepath.Join(snaps, snapshotTemp("cut"), snapshotTree, "half"), 0o755))
	entries, moved, err = b.root.MoveSnapshot("cut", "trash")
	if err != nil || !moved || len(entries) != 2 {
		t.Fatalf("MoveSnapshot of a delete cut short = %q, %v, %v; want two entries, moved", entries, moved, err)
	}
	for _, e := range entries {
		if _, err := os.Stat(filepath.Join(b.base, "trash", e, snapshotTree, "half")); err != nil {
			t.Errorf("trash entry %s: %v", e, err)
		}
	}
	if n, _ := os.ReadDir(snaps); len(n) != 0 {
		t.Errorf("snapshots directory holds %v, want nothing", n)
	}
}

// TestSnapshotLeftovers: a copy that failed is left for the next attempt (KeepFailed), which
// removes it and copies again; what a crash left of a snapshot being deleted is removed by the
// next DeleteSnapshot of the name.
func TestSnapshotLeftovers(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	dir := filepath.Join(b.base, snapshotsDir)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := b.root.Snapshot(ctx, "ns/src", "s", SnapshotOptions{KeepFailed: true}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled snapshot: %v, want context.Canceled", err)
	}
	if _, err := os.Stat(filepath.Join(dir, snapshotTemp("s"))); err != nil {
		t.Errorf("the failed copy was not kept: %v", err)
	}
	if _, err := b.root.Snapshot(context.Background(), "ns/src", "s", SnapshotOptions{KeepFailed: true}); err != nil {
		t.Fatal(err)
	}
	if n, _ := os.ReadDir(dir); len(n) != 1 {
		t.Errorf("snapshots directory holds %v, want the snapshot only", n)
	}
	must(t, os.MkdirAll(filepath.Join(dir, snapshotGonePrefix+nameHash("s"), snapshotTree, "half"), 0o755))
	if err := b.root.DeleteSnapshot("s"); err != nil {
		t.Fatal(err)
	}
	if n, _ := os.ReadDir(dir); len(n) != 0 {
		t.Errorf("snapshots directory holds %v, want nothing", n)
	}
}

// TestSnapshotCopyLimited: where the base enforces limits, a snapshot made by copying (its
// source is no btrfs subvolume) is held under a limit of the source's size: a source that
// holds more is refused and leaves nothing, limit included; one that fits gets a limit of its
// own, which its deletion gives back.
func TestSnapshotCopyLimited(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	mkVolume(t, r, "ns/src", Owner{Mode: 0o755, UID: -1, GID: -1}, Claim{UID: "src"})
	must(t, os.WriteFile(filepath.Join(mnt, "ns/src/big"), make([]byte, 4<<20), 0o644))
	before := quotatest.Qgroups(t, mnt)
	ctx := context.Background()

	_, err := r.Snapshot(ctx, "ns/src", "small", SnapshotOptions{Limit: 1 << 20})
	if !errors.Is(err, unix.EDQUOT) && !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("snapshot of 4 MiB under a limit of 1 MiB: %v, want EDQUOT", err)
	}
	if names, _ := os.ReadDir(filepath.Join(mnt, snapshotsDir)); len(names) != 0 {
		t.Errorf("the refused snapshot left %v", names)
	}
	if after := quotatest.Qgroups(t, mnt); len(after) != len(before) {
		t.Errorf("qgroups %v after the refused snapshot, want %v", after, before)
	}

	info, err := r.Snapshot(ctx, "ns/src", "fits", SnapshotOptions{Limit: 16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if info.Method == MethodBtrfsSnapshot {
		t.Fatalf("snapshot method %q, want a copy", info.Method)
	}
	tree, err := os.Open(filepath.Join(mnt, snapshotsDir, "fits", snapshotTree))
	must(t, err)
	dir, err := os.Open(filepath.Join(mnt, snapshotsDir, "fits"))
	must(t, err)
	fs, err := r.Quota()
	must(t, err)
	id, ok, err := fs.IDOf(int(dir.Fd()), int(tree.Fd()))
	if err != nil || !ok {
		t.Fatalf("the snapshot's tree has no limit of its own (%v)", err)
	}
	u, err := fs.Usage(int(tree.Fd()), id)
	must(t, err)
	tree.Close()
	dir.Close()
	if u.LimitBytes != 16<<20 {
		t.Errorf("the snapshot's limit is %d, want 16 MiB", u.LimitBytes)
	}
	must(t, r.DeleteSnapshot("fits"))
	if after := quotatest.Qgroups(t, mnt); len(after) != len(before) {
		t.Errorf("qgroups %v after the delete, want %v", after, before)
	}
}
