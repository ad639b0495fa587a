package volume

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// A removal in steps removes no more than each step's budget, carries on where the last step
// stopped, and ends with the tree gone, so a caller can bound each step by a deadline.
func TestRemovalInSteps(t *testing.T) {
	r, base := newRoot(t)
	const dirs, files = 5, 40
	for d := range dirs {
		dir := filepath.Join(base, "vol", "d"+strconv.Itoa(d), "deeper")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for f := range files {
			if err := os.WriteFile(filepath.Join(dir, strconv.Itoa(f)), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.Symlink("/etc", filepath.Join(base, "vol", "link")); err != nil {
		t.Fatal(err)
	}
	rm, err := r.StartRemoval("vol")
	if err != nil {
		t.Fatal(err)
	}
	defer rm.Close()
	total, steps := 0, 0
	for {
		n, done, err := rm.Step(7)
		if err != nil {
			t.Fatal(err)
		}
		if n > 7 {
			t.Fatalf("step removed %d entries, budget 7", n)
		}
		total += n
		steps++
		if done {
			break
		}
		if steps > 1000 {
			t.Fatal("removal does not end")
		}
	}
	// Every file, the link, each d<i> and its deeper, and vol itself.
	if want := dirs*files + 1 + 2*dirs + 1; total != want {
		t.Errorf("removed %d entries, want %d", total, want)
	}
	if _, err := os.Lstat(filepath.Join(base, "vol")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("vol after the removal: %v, want it gone", err)
	}
	if _, err := os.Stat("/etc/hostname"); err != nil {
		t.Errorf("symlink target touched: %v", err)
	}
}

// Move takes a volume out of its parent into another directory beneath the root, refuses to
// replace anything there, and never follows a symlink planted as the destination directory.
func TestMoveStaysBeneathRoot(t *testing.T) {
	r, base := newRoot(t)
	if _, err := r.MkdirAll("ns/vol", Owner{Mode: 0o755}, Claim{UID: "uid-vol", PVName: "pv-vol"}); err != nil {
		t.Fatal(err)
	}
	if err := r.Mkdir(".trash", 0o700); err != nil {
		t.Fatal(err)
	}
	outside := t.TempDir()
	if err := os.Symlink(outside, filepath.Join(base, "evil")); err != nil {
		t.Fatal(err)
	}
	if err := moveVolume(r, "ns/vol", "evil", "vol"); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("Move into a symlinked directory: %v, want ErrNotDirectory", err)
	}
	if err := r.Mkdir("evil", 0o700); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("Mkdir over a symlink: %v, want ErrNotDirectory", err)
	}
	if err := moveVolume(r, "ns/vol", "../x", "vol"); err == nil {
		t.Error("Move to a directory outside the root succeeded")
	}
	if err := os.Mkdir(filepath.Join(base, ".trash", "taken"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := moveVolume(r, "ns/vol", ".trash", "taken"); err == nil {
		t.Error("Move over an existing entry succeeded")
	}
	if err := moveVolume(r, "ns/vol", ".trash", "pv-1"); err != nil {
		t.Fatal(err)
	}
	if names, err := r.List(".trash"); err != nil || len(names) != 2 {
		t.Errorf("trash holds %v (%v), want taken and pv-1", names, err)
	}
	if _, err := os.Stat(filepath.Join(base, "ns/vol")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ns/vol after Move: %v, want it gone", err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("directory behind the symlink got %v", entries)
	}
}

// A duplicated handle keeps working after the original is closed, on the same directory.
func TestDupOutlivesClose(t *testing.T) {
	base := t.TempDir()
	r, err := OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	d, err := r.Dup()
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	r.Close()
	if _, err := d.MkdirAll("vol", Owner{Mode: 0o755}, Claim{UID: "uid-vol", PVName: "pv-vol"}); err != nil {
		t.Fatalf("MkdirAll on the duplicate after the original closed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(base, "vol")); err != nil {
		t.Errorf("directory made through the duplicate is not in the base: %v", err)
	}
}

// A tenant decides how many names a directory of its volume holds. A removal reads them a
// batch at a time and keeps no more than one batch, whatever the directory's size and however
// many directories it has descended through, so a directory of millions of names cannot run the
// controller out of memory; and it still removes every name, those of a batch cut short by a
// descent included.
func TestRemovalHoldsAtMostOneBatchOfNames(t *testing.T) {
	r, base := newRoot(t)
	const files, dirs, perDir = 3*removalBatch + 7, 6, removalBatch + 300
	mkfiles := func(dir string, n int) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for f := range n {
			if err := os.WriteFile(filepath.Join(dir, "file-with-a-long-name-"+strconv.Itoa(f)), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	mkfiles(filepath.Join(base, "vol"), files)
	for d := range dirs {
		mkfiles(filepath.Join(base, "vol", "d"+strconv.Itoa(d)), perDir)
	}
	rm, err := r.StartRemoval("vol")
	if err != nil {
		t.Fatal(err)
	}
	defer rm.Close()
	total, most := 0, 0
	for steps := 0; ; steps++ {
		n, done, err := rm.Step(97)
		if err != nil {
			t.Fatal(err)
		}
		total += n
		held := 0
		for _, l := range rm.stack {
			held += len(l.children)
		}
		most = max(most, held)
		if held > removalBatch {
			t.Fatalf("after %d entries removed the walk holds %d names, more than a batch of %d", total, held, removalBatch)
		}
		if done {
			break
		}
		if steps > 10*(files+dirs*perDir) {
			t.Fatal("removal does not end")
		}
	}
	if want := files + dirs*(perDir+1) + 1; total != want {
		t.Errorf("removed %d entries, want %d", total, want)
	}
	if _, err := os.Lstat(filepath.Join(base, "vol")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("vol after the removal: %v, want it gone", err)
	}
	t.Logf("at most %d names held at once", most)
}
