package quota_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

func openDir(t *testing.T, p string) int {
	t.Helper()
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	must(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

func probe(t *testing.T, fd int) *quota.FS {
	t.Helper()
	fs, err := quota.Probe(fd)
	must(t, err)
	return fs
}

// makeLimited makes base/name with a limit of bytes and returns its ID.
func makeLimited(t *testing.T, fs *quota.FS, base, name string, bytes uint64) quota.ID {
	t.Helper()
	must(t, fs.Mkdir(openDir(t, base), name, 0o755))
	id, err := fs.SetLimit(openDir(t, filepath.Join(base, name)), bytes)
	must(t, err)
	return id
}

func TestProbeSaysWhyNot(t *testing.T) {
	for name, dir := range map[string]func(*testing.T) string{
		"btrfs without quota":     func(t *testing.T) string { return quotatest.Btrfs(t, false) },
		"the temp dir (no quota)": func(t *testing.T) string { return t.TempDir() },
	} {
		t.Run(name, func(t *testing.T) {
			d := dir(t)
			var sfs unix.Statfs_t
			must(t, unix.Statfs(d, &sfs))
			fs := probe(t, openDir(t, d))
			err := fs.Enforces()
			if !errors.Is(err, quota.ErrNotEnforceable) {
				t.Fatalf("Enforces on %s (type %#x) = %v, want ErrNotEnforceable", name, sfs.Type, err)
			}
			if _, err := fs.SetLimit(openDir(t, d), 1<<20); !errors.Is(err, quota.ErrNotEnforceable) {
				t.Errorf("SetLimit = %v, want ErrNotEnforceable", err)
			}
			t.Logf("%s: %v", name, err)
		})
	}
}

func TestParseID(t *testing.T) {
	for _, s := range []string{"", "project", "project/0", "project/4294967296", "zfs/3", "btrfs/-1", "btrfs/x"} {
		if id, err := quota.ParseID(s); err == nil {
			t.Errorf("ParseID(%q) = %v, want an error", s, id)
		}
	}
	for _, s := range []string{"project/4294967295", "btrfs/257"} {
		if id, err := quota.ParseID(s); err != nil || id.String() != s {
			t.Errorf("ParseID(%q) = %v, %v", s, id, err)
		}
	}
}

// TestBtrfsResizeAndUnlimit: Resize raises the limit of the subvolume that carries the ID,
// refuses another volume's ID, and leaves the neighbour's limit enforced. Unlimit lifts the limit
// of the subvolume that carries the ID, even one that holds more than its limit (a snapshot clone
// that did not fit), and leaves a subvolume that carries another ID as it is. That a full
// volume's writer then writes past the old size: test/integration TestLocalClaimExpandsOnline.
func TestBtrfsResizeAndUnlimit(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	base := openDir(t, mnt)
	fs := probe(t, base)
	const limit = 8 << 20
	id := makeLimited(t, fs, mnt, "a", limit)
	neighbour := makeLimited(t, fs, mnt, "b", limit)
	a := openDir(t, filepath.Join(mnt, "a"))
	if err := fs.Resize(a, neighbour, 32<<20); err == nil {
		t.Fatal("Resize of a volume with its neighbour's ID succeeded, want a refusal")
	}
	must(t, fs.Resize(a, id, 32<<20))
	if u, err := fs.Usage(base, id); err != nil || u.LimitBytes != 32<<20 {
		t.Errorf("resized volume's limit reads %d (%v), want %d", u.LimitBytes, err, 32<<20)
	}
	if u, err := fs.Usage(base, neighbour); err != nil || u.LimitBytes != limit {
		t.Errorf("neighbour's limit reads %d (%v), want %d", u.LimitBytes, err, limit)
	}
	if n, err := quotatest.Fill(t, filepath.Join(mnt, "b", "file"), 16<<20); !errors.Is(err, unix.EDQUOT) || n > limit {
		t.Errorf("neighbour took %d bytes of 16 MiB (err %v), want EDQUOT within its %d", n, err, limit)
	}

	if n, err := quotatest.Fill(t, filepath.Join(mnt, "a", "big"), 16<<20); err != nil {
		t.Fatalf("wrote %d bytes of 16 MiB: %v", n, err)
	}
	must(t, fs.Resize(a, id, limit))
	unix.Sync()
	if err := fs.Unlimit(a, neighbour); err != nil {
		t.Fatalf("Unlimit with the neighbour's ID: %v", err)
	}
	if u, err := fs.Usage(base, neighbour); err != nil || u.LimitBytes != limit {
		t.Errorf("neighbour's limit after an Unlimit of another subvolume with its ID: %d (%v), want %d", u.LimitBytes, err, limit)
	}
	if err := fs.Unlimit(a, id); err != nil {
		t.Fatalf("Unlimit of a subvolume over its limit: %v", err)
	}
	if u, err := fs.Usage(base, id); err != nil || u.LimitBytes != 0 || u.UsedBytes < 16<<20 {
		t.Errorf("after Unlimit: %+v, %v; want no limit and 16 MiB used", u, err)
	}
}

// TestBtrfsIDOf: a volume directory that has no marker yet (a crash before it) is known by its
// subvolume, whose qgroup is the one to limit and release; a plain directory has no ID of its
// own, nor a limit (it would put it on the subvolume holding it). Once the subvolume is deleted
// (rmdir of an empty one, which is how volume.RemoveAll ends) its ID is released, twice alike.
func TestBtrfsIDOf(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	base := openDir(t, mnt)
	fs := probe(t, base)
	must(t, fs.Mkdir(base, "sub", 0o755))
	sub := openDir(t, filepath.Join(mnt, "sub"))
	got, ok, err := fs.IDOf(base, sub)
	if err != nil || !ok || got.Kind != quota.Btrfs {
		t.Fatalf("IDOf a new subvolume = %v, %v, %v; want its btrfs ID", got, ok, err)
	}
	id, err := fs.SetLimit(sub, 1<<20)
	if err != nil || id != got {
		t.Errorf("SetLimit = %v, %v; want the ID IDOf named, %v", id, err, got)
	}
	must(t, os.Mkdir(filepath.Join(mnt, "plain"), 0o755))
	plain := openDir(t, filepath.Join(mnt, "plain"))
	if id, ok, err := fs.IDOf(base, plain); err != nil || ok {
		t.Errorf("IDOf a plain directory = %v, %v, %v; want none", id, ok, err)
	}
	if id, err := fs.SetLimit(plain, 1<<20); err == nil {
		t.Errorf("SetLimit on a plain btrfs directory gave %v, want an error", id)
	}
	must(t, os.Remove(filepath.Join(mnt, "sub")))
	for range 2 {
		must(t, fs.Release(base, id))
	}
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
