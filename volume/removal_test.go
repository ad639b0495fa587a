package volume

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// A removal in steps removes no more than each step's budget, carries on where the last step
// stopped, and ends with the tree gone, so a caller can bound each step by a deadline. A tenant
// decides how many names a directory of its volume holds: the removal reads them a batch at a
// time and keeps no more than one batch, whatever the directory's size and however many
// directories it has descended through, so a directory of millions of names cannot run the
// controller out of memory; and it still removes every name, those of a batch cut short by a
// descent included. A symlink in the volume is removed, never followed.
func TestRemovalInSteps(t *testing.T) {
	r, base := newRoot(t)
	const files, dirs, perDir, budget = 3*dirBatch + 7, 6, dirBatch + 300, 97
	mkfiles := func(dir string, n int) {
		t.Helper()
		must(t, os.MkdirAll(dir, 0o755))
		for f := range n {
			must(t, os.WriteFile(filepath.Join(dir, "file-with-a-long-name-"+strconv.Itoa(f)), nil, 0o644))
		}
	}
	mkfiles(filepath.Join(base, "vol"), files)
	for d := range dirs {
		mkfiles(filepath.Join(base, "vol", "d"+strconv.Itoa(d), "deeper"), perDir)
	}
	must(t, os.Symlink("/etc", filepath.Join(base, "vol", "link")))
	rm, err := r.StartRemoval("vol")
	must(t, err)
	defer rm.Close()
	total, most := 0, 0
	for steps := 0; ; steps++ {
		n, done, err := rm.Step(budget)
		must(t, err)
		if n > budget {
			t.Fatalf("step removed %d entries, budget %d", n, budget)
		}
		total += n
		held := 0
		for _, l := range rm.stack {
			held += len(l.children)
		}
		most = max(most, held)
		if held > dirBatch {
			t.Fatalf("after %d entries removed the walk holds %d names, more than a batch of %d", total, held, dirBatch)
		}
		if done {
			break
		}
		if steps > 10*(files+dirs*perDir) {
			t.Fatal("removal does not end")
		}
	}
	// Every file, the link, each d<i> and its deeper, and vol itself.
	if want := files + 1 + dirs*(perDir+2) + 1; total != want {
		t.Errorf("removed %d entries, want %d", total, want)
	}
	absent(t, filepath.Join(base, "vol"), "vol after the removal")
	if _, err := os.Stat("/etc/hostname"); err != nil {
		t.Errorf("symlink target touched: %v", err)
	}
	t.Logf("at most %d names held at once", most)
}

// A mount inside a volume (a pod's bind mount, or one a tenant arranged) stops the removal:
// crossing it could delete data that is not the volume's.
func TestRemoveAllStopsAtMountPoints(t *testing.T) {
	r, base := newRoot(t)
	mkVolume(t, r, "vol/mnt", Owner{Mode: 0o755}, claimA)
	other := t.TempDir()
	must(t, os.WriteFile(filepath.Join(other, "data"), []byte("x"), 0o644))
	mnt := filepath.Join(base, "vol/mnt")
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, ""); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	must(t, os.WriteFile(filepath.Join(mnt, "data"), []byte("x"), 0o644))
	if err := r.RemoveAll("vol"); err == nil {
		t.Fatal("RemoveAll crossed a mount point")
	}
	if _, err := os.Stat(filepath.Join(mnt, "data")); err != nil {
		t.Errorf("file on the other file system was removed: %v", err)
	}

	// A bind mount of a directory on the same file system is a mount point too.
	must(t, unix.Unmount(mnt, 0))
	mkVolume(t, r, "other", Owner{Mode: 0o755}, claimA)
	must(t, os.WriteFile(filepath.Join(base, "other/keep"), []byte("x"), 0o644))
	if err := unix.Mount(filepath.Join(base, "other"), mnt, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount: %v", err)
	}
	if err := r.RemoveAll("vol"); err == nil {
		t.Fatal("RemoveAll crossed a same-file-system bind mount")
	}
	if _, err := os.Stat(filepath.Join(base, "other/keep")); err != nil {
		t.Errorf("file behind the bind mount was removed: %v", err)
	}
}
