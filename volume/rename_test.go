package volume

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestMkdirAllWithoutNoReplaceOneClaimWins is two claims named alike in two namespaces,
// provisioned at once by different workers, each on its own handle on the export (as every NFS
// call is): exactly one of them gets the directory, every other claim is refused, and the
// directory is the winner's.
func TestMkdirAllWithoutNoReplaceOneClaimWins(t *testing.T) {
	withoutNoReplace(t)
	base := t.TempDir()
	top, err := OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	defer top.Close()
	const rounds, claims = 50, 8
	for round := range rounds {
		rel := fmt.Sprintf("data-%d", round)
		roots := make([]*Root, claims)
		for i := range roots {
			if roots[i], err = top.Dup(); err != nil {
				t.Fatal(err)
			}
		}
		var (
			wg      sync.WaitGroup
			start   = make(chan struct{})
			created = make([]bool, claims)
			errs    = make([]error, claims)
		)
		for i := range claims {
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer roots[i].Close()
				<-start
				created[i], errs[i] = roots[i].MkdirAll(rel, Owner{Mode: 0o755, UID: -1, GID: -1},
					Claim{UID: fmt.Sprintf("uid-%d", i), PVName: fmt.Sprintf("pv-%d", i)})
			}()
		}
		close(start)
		wg.Wait()
		winner := -1
		for i := range claims {
			var exists *ExistsError
			switch {
			case errs[i] == nil && created[i]:
				if winner >= 0 {
					t.Fatalf("round %d: claims %d and %d both created %s", round, winner, i, rel)
				}
				winner = i
			case errors.As(errs[i], &exists):
			default:
				t.Fatalf("round %d: claim %d: created %v, err %v; want created or *ExistsError", round, i, created[i], errs[i])
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: no claim created %s", round, rel)
		}
		owner, marked, err := top.VolumeOwner(rel)
		if err != nil || !marked || owner.UID != fmt.Sprintf("uid-%d", winner) {
			t.Fatalf("round %d: %s is owned by %+v (marked %v, err %v), want uid-%d", round, rel, owner, marked, err, winner)
		}
	}
}

// TestRenameWithoutNoReplaceKeepsEmptyTarget is an archive rename onto a name taken by an
// empty directory where RENAME_NOREPLACE is refused: plain rename(2) would replace it.
func TestRenameWithoutNoReplaceKeepsEmptyTarget(t *testing.T) {
	withoutNoReplace(t)
	base := t.TempDir()
	r, err := OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, d := range []string{"vol", "vol/file-dir", "taken"} {
		if err := r.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
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

func TestRenameStaysInParent(t *testing.T) {
	r, base := newRoot(t)
	if _, err := r.MkdirAll("ns/vol", Owner{Mode: 0o755}, claimA); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"../x", "a/b", "..", ""} {
		if err := renameVolume(r, "ns/vol", bad); err == nil {
			t.Errorf("Rename to %q succeeded", bad)
		}
	}
	if _, err := r.MkdirAll("ns/taken", Owner{Mode: 0o755}, claimA); err != nil {
		t.Fatal(err)
	}
	if err := renameVolume(r, "ns/vol", "taken"); err == nil {
		t.Error("Rename over an existing directory succeeded")
	}
	if err := renameVolume(r, "ns/vol", "archived-vol"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(base, "ns/archived-vol")); err != nil {
		t.Errorf("archived directory missing: %v", err)
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
