package volume

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// baseFixture is a base path with a "disk" (a directory of its own, bind-mounted) that can be
// mounted on it and taken away again, and a node's state dir.
type baseFixture struct {
	t                 *testing.T
	base, disk, state string
	records           *BaseRecords
	// xattr is the attribute namespace of the roots opened (forEachBaseKind).
	xattr   string
	mounted bool
}

// forEachBaseKind runs test with the base's ID in a trusted attribute and, as on file systems
// without them, in its ID file.
func forEachBaseKind(t *testing.T, test func(t *testing.T, f *baseFixture)) {
	for _, kind := range []string{"xattr", "file"} {
		t.Run(kind, func(t *testing.T) {
			dir := t.TempDir()
			f := &baseFixture{t: t, base: filepath.Join(dir, "base"), disk: filepath.Join(dir, "disk"),
				state: filepath.Join(dir, "state"), xattr: volumeMarker}
			if kind == "file" {
				f.xattr = "dirpv.no-such-namespace"
			}
			must(t, os.Mkdir(f.base, 0o755))
			must(t, os.Mkdir(f.disk, 0o755))
			f.records = NewBaseRecords(f.state)
			t.Cleanup(func() {
				if f.mounted {
					unix.Unmount(f.base, unix.MNT_DETACH)
				}
			})
			test(t, f)
		})
	}
}

func (f *baseFixture) mount() {
	f.t.Helper()
	must(f.t, unix.Mount(f.disk, f.base, "", unix.MS_BIND, ""))
	f.mounted = true
}

// unmount takes the disk away as a failed mount at boot would leave it: the path then leads to
// the directory underneath. Lazily, since roots may still hold it.
func (f *baseFixture) unmount() {
	f.t.Helper()
	must(f.t, unix.Unmount(f.base, unix.MNT_DETACH))
	f.mounted = false
}

// open opens the base as the provisioner does: what its path leads to now.
func (f *baseFixture) open() *Root {
	f.t.Helper()
	r := rootAt(f.t, f.base)
	r.xattr = f.xattr
	return r
}

func (f *baseFixture) check() error {
	f.t.Helper()
	return f.records.Check(f.base, f.open())
}

// A base whose disk held a volume is refused once the disk is gone and the path leads to the
// directory underneath: with ErrBaseChanged, an error that names the record to remove, and
// nothing written underneath. It is refused for as long as the disk is away and accepted
// again as soon as it is back. Removing the record (the admin replaced the base on purpose)
// lets the new file system be adopted.
func TestBaseThatHeldVolumesMustKeepItsFileSystem(t *testing.T) {
	forEachBaseKind(t, func(t *testing.T, f *baseFixture) {
		f.mount()
		if err := f.check(); err != nil {
			t.Fatalf("first check of a new base: %v", err)
		}
		must(t, os.Mkdir(filepath.Join(f.base, "vol"), 0o755))
		must(t, f.records.MarkHeld(f.base))
		if err := f.check(); err != nil {
			t.Fatalf("check of the same base: %v", err)
		}

		f.unmount()
		for range 2 {
			err := f.check()
			if !errors.Is(err, ErrBaseChanged) {
				t.Fatalf("check with the disk gone = %v, want ErrBaseChanged", err)
			}
			for _, want := range []string{f.base, "carries no dirpv base ID", "not mounted", "remove " + f.records.RecordPath(f.base)} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
		}
		if got, err := os.ReadDir(f.base); len(got) != 0 || err != nil {
			t.Errorf("the directory underneath holds %v (%v) after the refusals, want nothing", got, err)
		}
		if id, err := f.open().BaseID(); id != "" || err != nil {
			t.Errorf("the directory underneath got base ID %q (%v)", id, err)
		}

		f.mount()
		if err := f.check(); err != nil {
			t.Fatalf("check with the disk back: %v", err)
		}

		// Another file system with an ID of its own is refused too.
		f.unmount()
		other := filepath.Join(filepath.Dir(f.base), "other")
		must(t, os.Mkdir(other, 0o755))
		otherRoot := rootAt(t, other)
		otherRoot.xattr = f.xattr
		must(t, NewBaseRecords(t.TempDir()).Check(other, otherRoot))
		must(t, unix.Mount(other, f.base, "", unix.MS_BIND, ""))
		f.mounted = true
		if err := f.check(); !errors.Is(err, ErrBaseChanged) || !strings.Contains(err.Error(), "carries base ID ") {
			t.Errorf("check of another dirpv base mounted there = %v, want ErrBaseChanged naming its ID", err)
		}
		f.unmount()

		// The admin says the base is gone for good.
		must(t, os.Remove(f.records.RecordPath(f.base)))
		if err := f.check(); err != nil {
			t.Fatalf("check after the record was removed: %v", err)
		}
		if held, err := f.records.Held(f.base); held || err != nil {
			t.Errorf("the empty directory adopted anew counts as holding volumes (%v)", err)
		}
	})
}

// A base that never held a volume may change freely: an admin who creates a class before
// mounting its disk has the empty directory adopted first (a capacity poll, say), and the
// disk is adopted in its place once mounted. From its first volume on, the disk must stay.
func TestBaseThatNeverHeldAVolumeIsAdoptedAnew(t *testing.T) {
	forEachBaseKind(t, func(t *testing.T, f *baseFixture) {
		if err := f.check(); err != nil {
			t.Fatalf("check of the empty directory: %v", err)
		}
		under, err := f.open().BaseID()
		if err != nil || under == "" {
			t.Fatalf("the adopted directory has base ID %q (%v)", under, err)
		}
		f.mount()
		if err := f.check(); err != nil {
			t.Fatalf("check of the disk mounted after the class was used: %v", err)
		}
		onDisk, err := f.open().BaseID()
		if err != nil || onDisk == "" || onDisk == under {
			t.Fatalf("the disk has base ID %q (%v), want one of its own (underneath: %q)", onDisk, err, under)
		}
		must(t, f.records.MarkHeld(f.base))
		f.unmount()
		if err := f.check(); !errors.Is(err, ErrBaseChanged) {
			t.Errorf("check of the directory underneath once the disk held a volume = %v, want ErrBaseChanged", err)
		}
		_, file := os.Lstat(filepath.Join(f.disk, baseIDFile))
		if (f.xattr == volumeMarker) != os.IsNotExist(file) {
			t.Errorf("ID file on the disk: %v, want one only where trusted attributes are not used", file)
		}
	})
}

// A base first seen holding entries (volumes made before dirpv kept records) counts as
// holding volumes; what a new file system or dirpv's own bookkeeping puts there does not.
func TestBaseFirstSeenWithEntriesCountsAsHeld(t *testing.T) {
	for name, tc := range map[string]struct {
		names []string
		held  bool
	}{
		"empty":                {nil, false},
		"new ext4":             {[]string{"lost+found"}, false},
		"dirpv's own":          {[]string{"lost+found", ReservedPrefix + "trash"}, false},
		"a volume made before": {[]string{"lost+found", "ns-data-pvc-1"}, true},
	} {
		t.Run(name, func(t *testing.T) {
			base := t.TempDir()
			for _, n := range tc.names {
				must(t, os.Mkdir(filepath.Join(base, n), 0o755))
			}
			r := rootAt(t, base)
			records := NewBaseRecords(t.TempDir())
			must(t, records.Check(base, r))
			if held, err := records.Held(base); held != tc.held || err != nil {
				t.Errorf("held = %v (%v), want %v", held, err, tc.held)
			}
		})
	}
}

// Workers that first use a base at once adopt it once: one ID, on the base and in its record.
func TestBaseAdoptedOnceByConcurrentChecks(t *testing.T) {
	base := t.TempDir()
	records := NewBaseRecords(t.TempDir())
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() {
			r, err := OpenRoot(base)
			if err != nil {
				errs[i] = err
				return
			}
			defer r.Close()
			errs[i] = records.Check(base, r)
		})
	}
	wg.Wait()
	must(t, errors.Join(errs...))
	r := rootAt(t, base)
	id, err := r.BaseID()
	must(t, err)
	rec, err := records.read(base)
	if err != nil || rec == nil || rec.ID != id {
		t.Fatalf("record %+v (%v), base ID %q: want the record to name the base's ID", rec, err, id)
	}
}

// An ID dirpv did not write is an error, not a reason to adopt the base or refuse it as
// changed.
func TestBaseIDNotDirpvsIsAnError(t *testing.T) {
	base := t.TempDir()
	must(t, unix.Setxattr(base, baseMarker, []byte("../../etc"), 0))
	r := rootAt(t, base)
	err := NewBaseRecords(t.TempDir()).Check(base, r)
	if err == nil || errors.Is(err, ErrBaseChanged) || !strings.Contains(err.Error(), "not an ID dirpv made") {
		t.Errorf("check = %v, want an error saying the ID is not dirpv's", err)
	}
}
