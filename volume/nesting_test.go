package volume

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/framework"
)

var (
	claimA = Claim{UID: "uid-a", PVName: "pvc-uid-a"}
	claimB = Claim{UID: "uid-b", PVName: "pvc-uid-b"}
)

// forEachMarker runs test once with the trusted attribute local bases get and once with the
// record files of file systems without trusted attributes (NFS): an attribute namespace the
// kernel does not know fails with EOPNOTSUPP, as trusted.* does on NFS.
func forEachMarker(t *testing.T, test func(t *testing.T, r *Root, base string)) {
	for _, kind := range []string{"xattr", "record"} {
		t.Run(kind, func(t *testing.T) {
			r, base := newRoot(t)
			if kind == "record" {
				r.xattr = "dirpv.no-such-namespace"
				if err := unix.Setxattr(base, r.xattr, []byte("x"), 0); !errors.Is(err, unix.EOPNOTSUPP) {
					t.Fatalf("setxattr %s = %v, want EOPNOTSUPP", r.xattr, err)
				}
			}
			test(t, r, base)
		})
	}
}

// records lists the owner record files in dir.
func records(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	must(t, err)
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), recordPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// Two classes may share a base with patterns of different depths, say ${annotations['dir']}
// and ${labels['team']}/${pvc.metadata.name}. A tenant of the first then owns a volume
// "finance"; a claim of the second with team=finance must not get a directory inside that
// volume, where the first tenant could read and change it and where deleting the first
// volume would delete it.
func TestMkdirAllRefusesToNestInsideAnotherVolume(t *testing.T) {
	forEachMarker(t, func(t *testing.T, r *Root, base string) {
		owner := Owner{Mode: 0o777, UID: -1, GID: -1}
		if created, err := r.MkdirAll("finance", owner, claimA); err != nil || !created {
			t.Fatalf("first volume: %v %v", created, err)
		}
		_, err := r.MkdirAll("finance/victim", owner, claimB)
		if !errors.Is(err, ErrInsideVolume) {
			t.Fatalf("volume inside another volume: err %v, want ErrInsideVolume", err)
		}
		absent(t, filepath.Join(base, "finance/victim"), "finance/victim exists after the refusal")
		_, err = r.MkdirAll("finance/a/b/victim", owner, claimB)
		if !errors.Is(err, ErrInsideVolume) {
			t.Fatalf("volume deep inside another volume: err %v, want ErrInsideVolume", err)
		}

		// Intermediate directories dirpv made are not volumes: siblings share them.
		if created, err := r.MkdirAll("ns/a", owner, claimA); err != nil || !created {
			t.Fatalf("ns/a: %v %v", created, err)
		}
		if created, err := r.MkdirAll("ns/b", owner, claimB); err != nil || !created {
			t.Fatalf("ns/b: %v %v", created, err)
		}
		if owner, marked, err := r.VolumeOwner("ns/a"); err != nil || !marked || owner != claimA {
			t.Errorf("VolumeOwner(ns/a) = %+v %v %v, want %+v", owner, marked, err, claimA)
		}
		if _, marked, err := r.VolumeOwner("ns"); err != nil || marked {
			t.Errorf("intermediate ns is marked as a volume (err %v)", err)
		}
		if r.xattr == volumeMarker {
			// A trusted.* attribute: a pod (without CAP_SYS_ADMIN) can neither forge it nor
			// strip it, and it lives on the directory, so it survives a restart of dirpv.
			if _, err := unix.Lgetxattr(filepath.Join(base, "ns/a"), volumeMarker, make([]byte, 64)); err != nil {
				t.Errorf("volume ns/a has no %s: %v", volumeMarker, err)
			}
			if got := records(t, filepath.Join(base, "ns")); len(got) != 0 {
				t.Errorf("record files %v beside volumes that carry the attribute", got)
			}
		} else if got := records(t, filepath.Join(base, "ns")); len(got) != 2 {
			t.Errorf("record files in ns: %v, want one per volume", got)
		}
	})
}

// tree describes everything under dir (names, types, modes, owners, file contents), to show
// that a refusal changed nothing.
func tree(t *testing.T, dir string) map[string]string {
	t.Helper()
	out, err := framework.SnapshotTree(dir, nil)
	must(t, err)
	return out
}

func sameTree(t *testing.T, what string, before, after map[string]string) {
	t.Helper()
	for _, d := range framework.DiffSnapshots(before, after) {
		t.Errorf("%s: %s", what, d)
	}
}

// A volume gets exactly the class's mode and owner, whatever the umask; its parents stay
// root's. A pattern without ${pv.metadata.name} maps claims to directories by name alone. The
// claim a directory was made for gets it back when it asks again (its PV was never saved), as
// it is; any other claim is refused and nothing on disk changes.
func TestMkdirAllAdoptsOnlyItsOwnClaimsDirectory(t *testing.T) {
	forEachMarker(t, func(t *testing.T, r *Root, base string) {
		owner := Owner{Mode: 0o2770, UID: 1234, GID: 5678}
		umask := unix.Umask(0o077)
		created, err := r.MkdirAll("ns/db", owner, claimA)
		unix.Umask(umask)
		if err != nil || !created {
			t.Fatalf("MkdirAll = %v %v", created, err)
		}
		var st unix.Stat_t
		must(t, unix.Stat(filepath.Join(base, "ns/db"), &st))
		if st.Mode&0o7777 != 0o2770 || st.Uid != 1234 || st.Gid != 5678 {
			t.Errorf("volume mode %o owner %d:%d, want 2770 1234:5678 despite umask 077", st.Mode&0o7777, st.Uid, st.Gid)
		}
		must(t, unix.Stat(filepath.Join(base, "ns"), &st))
		if st.Uid != 0 {
			t.Errorf("parent owner = %d, want root: only the volume itself belongs to the class's uid", st.Uid)
		}
		must(t, os.WriteFile(filepath.Join(base, "ns/db/data"), []byte("a's data"), 0o600))
		before := tree(t, base)

		created, err = r.MkdirAll("ns/db", Owner{Mode: 0o700, UID: 1, GID: 1}, claimA)
		if err != nil || created {
			t.Fatalf("same claim again: created %v err %v, want adopted", created, err)
		}
		sameTree(t, "after adoption", before, tree(t, base))

		_, err = r.MkdirAll("ns/db", owner, claimB)
		var exists *ExistsError
		if !errors.As(err, &exists) || !exists.Marked || exists.Owner != claimA {
			t.Fatalf("other claim: err %v, want an ExistsError naming %+v", err, claimA)
		}
		sameTree(t, "after another claim's refusal", before, tree(t, base))

		// A directory dirpv did not make (no marker) is nobody's to adopt.
		must(t, os.Mkdir(filepath.Join(base, "ns/manual"), 0o755))
		before = tree(t, base)
		_, err = r.MkdirAll("ns/manual", owner, claimA)
		if !errors.As(err, &exists) || exists.Marked {
			t.Fatalf("unmarked directory: err %v, want an ExistsError without a marker", err)
		}
		sameTree(t, "after refusing an unmarked directory", before, tree(t, base))
	})
}

// A volume is marked before it appears under its name, so a volume asked for inside it as
// soon as the name shows up is refused every time: there is no moment at which the directory
// is there but not yet known to be a volume.
func TestNoVolumeInsideOneBeingMade(t *testing.T) {
	forEachMarker(t, func(t *testing.T, r *Root, base string) {
		owner := Owner{Mode: 0o777, UID: -1, GID: -1}
		// Before volumes were made under a temporary name, 300 rounds here put a volume inside
		// a fresh one 87 times.
		for i := 0; i < 150; i++ {
			name := fmt.Sprintf("v%d", i)
			done := make(chan error, 1)
			go func() {
				_, err := r.MkdirAll(name, owner, claimA)
				done <- err
			}()
			var outerErr error
			finished := false
			for !finished {
				select {
				case outerErr = <-done:
					finished = true
				default:
				}
				if _, err := os.Lstat(filepath.Join(base, name)); err != nil {
					continue
				}
				_, err := r.MkdirAll(name+"/inner", owner, claimB)
				if !errors.Is(err, ErrInsideVolume) {
					t.Fatalf("%s appeared and a volume inside it got %v, want ErrInsideVolume", name, err)
				}
				break
			}
			if !finished {
				outerErr = <-done
			}
			if outerErr != nil {
				t.Fatalf("%s: %v", name, outerErr)
			}
			if _, err := os.Lstat(filepath.Join(base, name, "inner")); !os.IsNotExist(err) {
				t.Fatalf("%s/inner exists: %v", name, err)
			}
		}
	})
}

// openNewDir makes the directory name in the base and opens it (O_PATH) for the test.
func openNewDir(t *testing.T, r *Root, base, name string) int {
	t.Helper()
	must(t, os.Mkdir(filepath.Join(base, name), 0o755))
	fd, err := r.openDir(name, unix.O_PATH)
	must(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// What a crash leaves between mkdir and the rename into place sits under a reserved name:
// no pattern can name it, the same claim's next attempt removes it, other claims ignore it.
// A crash inside the rename into place where the file system has no RENAME_NOREPLACE (NFS)
// leaves the name claimed by an empty mode-0 directory beside the claim's complete temporary
// one: the claim's retry removes that placeholder and makes the volume. A placeholder with
// something in it, or without the claim's temporary directory beside it, is refused as before.
func TestCrashLeftoversAreRetried(t *testing.T) {
	forEachMarker(t, func(t *testing.T, r *Root, base string) {
		owner := Owner{Mode: 0o750, UID: -1, GID: -1}
		ns := openNewDir(t, r, base, "ns")
		// crash leaves what claim A's attempt at name leaves when it dies: its volume made and
		// marked under its temporary name, and, inside the rename, the placeholder, which may
		// hold a file.
		crash := func(name string, placeholder, inPlaceholder bool) string {
			t.Helper()
			tmp := tempName(claimA, name)
			if _, err := r.makeMarked(ns, tmp, owner, claimA, 0, nil); err != nil {
				t.Fatal(err)
			}
			if placeholder {
				must(t, unix.Mkdirat(ns, name, 0))
			}
			if inPlaceholder {
				must(t, os.WriteFile(filepath.Join(base, "ns", name, "data"), nil, 0o600))
			}
			return tmp
		}
		// retry is claim A's next attempt at name: a fresh, empty volume of its own, the
		// leftovers gone.
		retry := func(name string) {
			t.Helper()
			if created, err := r.MkdirAll("ns/"+name, owner, claimA); err != nil || !created {
				t.Fatalf("retry of %s: %v %v", name, created, err)
			}
			absent(t, filepath.Join(base, "ns", tempName(claimA, name)), "the temporary directory after the retry")
			if entries, err := os.ReadDir(filepath.Join(base, "ns", name)); err != nil || len(entries) != 0 {
				t.Errorf("retried volume %s holds %v (%v), want it empty", name, entries, err)
			}
			var st unix.Stat_t
			if err := unix.Stat(filepath.Join(base, "ns", name), &st); err != nil || st.Mode&0o7777 != 0o750 {
				t.Errorf("retried volume %s mode %o (%v), want 750", name, st.Mode&0o7777, err)
			}
			if got, _, err := r.VolumeOwner("ns/" + name); err != nil || got != claimA {
				t.Errorf("retried volume %s's owner %+v (%v), want claim A", name, got, err)
			}
		}

		leftover := crash("db", false, false)
		must(t, os.WriteFile(filepath.Join(base, "ns", leftover, "half"), nil, 0o600))
		if !strings.HasPrefix(leftover, ReservedPrefix) {
			t.Fatalf("temporary name %q is not reserved", leftover)
		}
		for _, rel := range []string{"ns/" + leftover, "ns/" + leftover + "/x", ReservedPrefix + "x"} {
			if _, err := r.MkdirAll(rel, owner, claimB); !errors.Is(err, ErrReservedName) {
				t.Errorf("MkdirAll(%q) = %v, want ErrReservedName", rel, err)
			}
		}
		// Another claim's volume beside it is made as usual and leaves it alone.
		if created, err := r.MkdirAll("ns/other", owner, claimB); err != nil || !created {
			t.Fatalf("other claim: %v %v", created, err)
		}
		if _, err := os.Stat(filepath.Join(base, "ns", leftover, "half")); err != nil {
			t.Errorf("another claim's attempt touched the leftover: %v", err)
		}
		retry("db")

		crash("placed", true, false)
		retry("placed")

		crash("full", true, true)
		var exists *ExistsError
		if _, err := r.MkdirAll("ns/full", owner, claimA); !errors.As(err, &exists) {
			t.Errorf("placeholder holding a file: %v, want ExistsError", err)
		}
		if _, err := os.Stat(filepath.Join(base, "ns/full/data")); err != nil {
			t.Errorf("the file in the refused directory: %v", err)
		}
		must(t, unix.Mkdirat(ns, "stray", 0))
		if _, err := r.MkdirAll("ns/stray", owner, claimA); !errors.As(err, &exists) {
			t.Errorf("empty mode-0 directory without a temporary one: %v, want ExistsError", err)
		}
		crash("theirs", true, false)
		if _, err := r.MkdirAll("ns/theirs", owner, claimB); !errors.As(err, &exists) {
			t.Errorf("another claim at claim A's placeholder: %v, want ExistsError", err)
		}
	})
}

// Archiving renames a volume, an NFS delete moves it into another directory (the trash), and
// deleting removes it: the marker goes with the directory, and no record is left behind in
// any directory it was in.
func TestMarkerFollowsItsVolume(t *testing.T) {
	forEachMarker(t, func(t *testing.T, r *Root, base string) {
		owner := Owner{Mode: 0o755, UID: -1, GID: -1}
		for _, rel := range []string{"ns/a", "ns/b"} {
			mkVolume(t, r, rel, owner, claimA)
		}
		must(t, renameVolume(r, "ns/a", "archived-a"))
		must(t, r.Mkdir(".dirpv-trash", 0o700))
		must(t, moveVolume(r, "ns/b", ".dirpv-trash", "pv-b"))
		for _, rel := range []string{"ns/archived-a", ".dirpv-trash/pv-b"} {
			if got, marked, err := r.VolumeOwner(rel); err != nil || !marked || got != claimA {
				t.Errorf("%s's owner %+v marked %v (%v)", rel, got, marked, err)
			}
		}
		if _, err := r.MkdirAll("ns/archived-a/x", owner, claimB); !errors.Is(err, ErrInsideVolume) {
			t.Errorf("volume inside an archived one: %v, want ErrInsideVolume", err)
		}
		for _, rel := range []string{"ns/archived-a", ".dirpv-trash/pv-b"} {
			must(t, r.RemoveAll(rel))
		}
		for _, dir := range []string{"ns", ".dirpv-trash"} {
			if entries, err := os.ReadDir(filepath.Join(base, dir)); err != nil || len(entries) != 0 {
				t.Errorf("%s holds %v (%v) after its volumes were removed", dir, entries, err)
			}
		}
	})
}
