package volume

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/internal/keyed"
)

// withoutNoReplace makes renames behave as on the Linux NFS client, which refuses
// RENAME_NOREPLACE with EINVAL, for the rest of the test.
func withoutNoReplace(t *testing.T) {
	t.Helper()
	orig := renameat2
	renameat2 = func(olddirfd int, oldpath string, newdirfd int, newpath string, flags uint) error {
		if flags&unix.RENAME_NOREPLACE != 0 {
			return unix.EINVAL
		}
		return orig(olddirfd, oldpath, newdirfd, newpath, flags)
	}
	t.Cleanup(func() { renameat2 = orig })
}

// TestRenameWithoutNoReplaceKeepsEmptyTarget is an archive rename onto a name taken by an
// empty directory where RENAME_NOREPLACE is refused: plain rename(2) would replace it.
func TestRenameWithoutNoReplaceKeepsEmptyTarget(t *testing.T) {
	withoutNoReplace(t)
	base := t.TempDir()
	r := rootAt(t, base)
	for _, d := range []string{"vol", "vol/file-dir", "taken"} {
		must(t, r.Mkdir(d, 0o755))
	}
	if err := renameVolume(r, "vol", "taken"); !errors.Is(err, unix.EEXIST) {
		t.Fatalf("Rename onto an empty directory: %v, want EEXIST", err)
	}
	if names, err := r.List("taken"); err != nil || len(names) != 0 {
		t.Fatalf("taken holds %v (err %v), want it empty and untouched", names, err)
	}
	if names, err := r.List("vol"); err != nil || len(names) != 1 {
		t.Fatalf("vol holds %v (err %v), want it where it was", names, err)
	}
}

// TestRenameLockIsPerTarget: a rename stuck on one target (a dead NFS server) holds only that
// target; a second rename of it waits, a rename of another target does not.
func TestRenameLockIsPerTarget(t *testing.T) {
	var locks keyed.Locks[renameTarget]
	stuck := renameTarget{dirIno: 7, name: "data"}
	unlockStuck := locks.MustLock(stuck)
	other := make(chan struct{})
	go func() {
		locks.MustLock(renameTarget{dirIno: 8, name: "data"})()
		locks.MustLock(renameTarget{dirIno: 7, name: "other"})()
		close(other)
	}()
	select {
	case <-other:
	case <-time.After(10 * time.Second):
		t.Fatal("a rename of another target waited for the stuck one")
	}
	same := make(chan struct{})
	go func() {
		locks.MustLock(stuck)()
		close(same)
	}()
	// The second locker of stuck is counted once it waits; it must still be waiting then.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if locks.Users(stuck) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("second rename of the stuck target never started waiting")
		}
		runtime.Gosched()
	}
	select {
	case <-same:
		t.Fatal("a second rename of the same target did not wait for the first")
	default:
	}
	unlockStuck()
	select {
	case <-same:
	case <-time.After(10 * time.Second):
		t.Fatal("the second rename of the target never got it after the first ended")
	}
	if n := locks.Users(stuck); n != 0 {
		t.Fatalf("%d holders of the target after every rename ended", n)
	}
}

// Rename keeps a volume in its parent and Move takes it into another directory beneath the
// root; neither replaces anything there, and Move never follows a symlink planted as the
// destination directory.
func TestRenameAndMoveStayBeneathRoot(t *testing.T) {
	r, base := newRoot(t)
	for _, rel := range []string{"ns/vol", "ns/taken"} {
		mkVolume(t, r, rel, Owner{Mode: 0o755}, claimA)
	}
	for _, bad := range []string{"../x", "a/b", "..", "", "taken"} {
		if err := renameVolume(r, "ns/vol", bad); err == nil {
			t.Errorf("Rename to %q succeeded", bad)
		}
	}
	must(t, renameVolume(r, "ns/vol", "archived-vol"))

	must(t, r.Mkdir(".trash", 0o700))
	outside := t.TempDir()
	must(t, os.Symlink(outside, filepath.Join(base, "evil")))
	if err := moveVolume(r, "ns/archived-vol", "evil", "vol"); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("Move into a symlinked directory: %v, want ErrNotDirectory", err)
	}
	if err := r.Mkdir("evil", 0o700); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("Mkdir over a symlink: %v, want ErrNotDirectory", err)
	}
	if err := moveVolume(r, "ns/archived-vol", "../x", "vol"); err == nil {
		t.Error("Move to a directory outside the root succeeded")
	}
	must(t, os.Mkdir(filepath.Join(base, ".trash", "taken"), 0o755))
	if err := moveVolume(r, "ns/archived-vol", ".trash", "taken"); err == nil {
		t.Error("Move over an existing entry succeeded")
	}
	must(t, moveVolume(r, "ns/archived-vol", ".trash", "pv-1"))
	if names, err := r.List(".trash"); err != nil || len(names) != 2 {
		t.Errorf("trash holds %v (%v), want taken and pv-1", names, err)
	}
	absent(t, filepath.Join(base, "ns/archived-vol"), "the volume after Move")
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("directory behind the symlink got %v", entries)
	}
}

// TestHelperCrash is the process the crash tests start: in the base DIRPV_TEST_CRASH_BASE it
// does what DIRPV_TEST_CRASH_OP names, a rename as on NFS, and dies at the armed failpoint.
func TestHelperCrash(t *testing.T) {
	base, op := os.Getenv("DIRPV_TEST_CRASH_BASE"), os.Getenv("DIRPV_TEST_CRASH_OP")
	if base == "" {
		t.Skip("run by the crash tests")
	}
	withoutNoReplace(t)
	r, err := OpenRoot(base)
	must(t, err)
	switch op {
	case "snapshot":
		_, err = r.Snapshot(context.Background(), "ns/src", "snap", SnapshotOptions{})
	case "move":
		must(t, r.Mkdir("trash", 0o700))
		err = moveVolume(r, "ns/src", "trash", "pv-src")
	default:
		t.Fatalf("unknown DIRPV_TEST_CRASH_OP %q", op)
	}
	t.Fatalf("the %s returned (%v) instead of dying at its failpoint", op, err)
}

// crashInRename runs op in base in a process of its own (TestHelperCrash), as on NFS, and
// checks that it was killed at the failpoint inside the rename into place, after the
// placeholder claimed the name target (relative to base), and nowhere else.
func crashInRename(t *testing.T, base, op, target string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperCrash$", "-test.v")
	cmd.Env = append(os.Environ(), "DIRPV_TEST_CRASH_BASE="+base, "DIRPV_TEST_CRASH_OP="+op, failpoint.Env+"="+failpoint.RenameClaimed)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("%s armed to die at %s: %v, want killed\n%s", op, failpoint.RenameClaimed, err, out)
	}
	if !strings.Contains(string(out), "failpoint "+failpoint.RenameClaimed+" reached") {
		t.Fatalf("the process was killed, but not at %s:\n%s", failpoint.RenameClaimed, out)
	}
	var st unix.Stat_t
	must(t, unix.Lstat(filepath.Join(base, target), &st))
	if names, err := os.ReadDir(filepath.Join(base, target)); err != nil || len(names) != 0 || st.Mode&0o7777 != placeholderMode {
		t.Fatalf("the crash left at %s %v (mode %o, %v), want the empty placeholder", target, names, st.Mode&0o7777, err)
	}
}

// TestSnapshotRenameCrash: a controller killed inside the NFS rename of a complete snapshot
// into place (after the placeholder claimed its name) leaves the placeholder and the whole
// copy; the retry renames that copy into place instead of copying again and then failing on
// the placeholder for ever.
func TestSnapshotRenameCrash(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	crashInRename(t, b.base, "snapshot", snapshotsDir+"/snap")
	dir := filepath.Join(b.base, snapshotsDir)
	var copied unix.Stat_t
	tmp := filepath.Join(dir, snapshotTemp("snap"))
	must(t, unix.Lstat(filepath.Join(tmp, snapshotTree), &copied))
	if _, err := os.Stat(filepath.Join(tmp, snapshotInfoFile)); err != nil {
		t.Fatalf("the crash left no complete copy: %v", err)
	}

	withoutNoReplace(t)
	info, err := b.root.Snapshot(context.Background(), "ns/src", "snap", SnapshotOptions{})
	if err != nil {
		t.Fatalf("snapshot after the crash: %v", err)
	}
	if info.Name != "snap" || info.Source != "ns/src" {
		t.Errorf("snapshot after the crash: %+v", info)
	}
	var tree unix.Stat_t
	must(t, unix.Lstat(filepath.Join(dir, "snap", snapshotTree), &tree))
	if tree.Ino != copied.Ino {
		t.Errorf("the snapshot's tree is inode %d, want %d: the copy the crash left was thrown away and made again", tree.Ino, copied.Ino)
	}
	diffTrees(t, expectedCopy(t, filepath.Join(b.base, "ns/src")), treeHash(t, filepath.Join(dir, "snap", snapshotTree)))
	if names, _ := os.ReadDir(dir); len(names) != 1 {
		t.Errorf("snapshots directory holds %v, want the snapshot only", names)
	}
}

// TestMoveRenameCrash: a controller killed inside the NFS rename of a volume to the trash (or
// to its archive name) leaves the placeholder there and the volume where it was; the retry of
// the same move puts the volume under the name it was to get, and no empty directory is left.
func TestMoveRenameCrash(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	want := treeHash(t, filepath.Join(b.base, "ns/src"))
	crashInRename(t, b.base, "move", "trash/pv-src")
	withoutNoReplace(t)
	// The retry is the same move: the trash entry is named after the PV.
	if err := moveVolume(b.root, "ns/src", "trash", "pv-src"); err != nil {
		t.Fatalf("move after the crash: %v", err)
	}
	diffTrees(t, want, treeHash(t, filepath.Join(b.base, "trash/pv-src")))
	if owner, marked, err := b.root.VolumeOwner("trash/pv-src"); err != nil || !marked || owner.UID != "src-uid" {
		t.Errorf("trash/pv-src is owned by %+v (marked %v, %v), want the moved volume, src-uid", owner, marked, err)
	}
	absent(t, filepath.Join(b.base, "ns/src"), "ns/src after the move")
}
