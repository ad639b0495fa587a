package volume

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func newRoot(t *testing.T) (*Root, string) {
	t.Helper()
	base := t.TempDir()
	r, err := OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r, base
}

func TestMkdirAllSetsExactModeAndOwner(t *testing.T) {
	r, base := newRoot(t)
	old := unix.Umask(0o077)
	defer unix.Umask(old)

	created, err := r.MkdirAll("ns/vol", Owner{Mode: 0o2770, UID: 1234, GID: 5678}, claimA)
	if err != nil || !created {
		t.Fatalf("MkdirAll = %v, %v; want created", created, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(base, "ns/vol"), &st); err != nil {
		t.Fatal(err)
	}
	if got := st.Mode & 0o7777; got != 0o2770 {
		t.Errorf("mode = %o, want 2770 despite umask 077", got)
	}
	if st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("owner = %d:%d, want 1234:5678", st.Uid, st.Gid)
	}
	if err := unix.Stat(filepath.Join(base, "ns"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 {
		t.Errorf("parent owner = %d, want root: only the volume itself belongs to the class's uid", st.Uid)
	}

	created, err = r.MkdirAll("ns/vol", Owner{Mode: 0o700}, claimA)
	if err != nil || created {
		t.Fatalf("second MkdirAll = %v, %v; want existing directory, no error", created, err)
	}
	if err := unix.Stat(filepath.Join(base, "ns/vol"), &st); err != nil || st.Mode&0o7777 != 0o2770 {
		t.Errorf("existing directory's mode changed to %o (err %v)", st.Mode&0o7777, err)
	}
}

func TestRefusesBadRelativePaths(t *testing.T) {
	r, _ := newRoot(t)
	for _, rel := range []string{"", "/etc", "..", "a/../../b", "a//b", "./a", "a/.", "a\x00b", string(make([]byte, 256))} {
		if _, err := r.MkdirAll(rel, Owner{Mode: 0o755}, claimA); err == nil {
			t.Errorf("MkdirAll(%q) succeeded", rel)
		}
		if err := r.RemoveAll(rel); err == nil {
			t.Errorf("RemoveAll(%q) succeeded", rel)
		}
	}
}

// A tenant who controls a directory inside the base can plant symlinks; none is followed.
func TestSymlinksAreNeverFollowed(t *testing.T) {
	r, base := newRoot(t)
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("keep"), 0o600); err != nil {
		t.Fatal(err)
	}
	// "ns" is a symlink to a directory outside the base.
	if err := os.Symlink(outside, filepath.Join(base, "ns")); err != nil {
		t.Fatal(err)
	}
	if _, err := r.MkdirAll("ns/vol", Owner{Mode: 0o755}, claimA); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("MkdirAll through a symlink: err = %v, want ErrNotDirectory", err)
	}
	if _, err := os.Stat(filepath.Join(outside, "vol")); !os.IsNotExist(err) {
		t.Errorf("MkdirAll created a directory outside the base (stat err %v)", err)
	}
	if err := r.RemoveAll("ns/secret"); err == nil {
		t.Errorf("RemoveAll through a symlinked parent succeeded")
	}
	if err := renameVolume(r, "ns/secret", "x"); err == nil {
		t.Errorf("Rename through a symlinked parent succeeded")
	}
	if _, err := r.OpenDir("ns"); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("OpenDir of a symlink: err = %v, want ErrNotDirectory", err)
	}

	// Removing a volume that contains links removes the links, not their targets.
	if _, err := r.MkdirAll("vol", Owner{Mode: 0o755}, claimA); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(base, "vol/dirlink")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(secret, filepath.Join(base, "vol/filelink")); err != nil {
		t.Fatal(err)
	}
	if err := r.RemoveAll("vol"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "keep" {
		t.Errorf("target outside the base changed: %q, %v", b, err)
	}
	if _, err := os.Lstat(filepath.Join(base, "vol")); !os.IsNotExist(err) {
		t.Errorf("volume still there after RemoveAll: %v", err)
	}
	if err := r.RemoveAll("vol"); err != nil {
		t.Errorf("RemoveAll of a missing directory: %v, want nil", err)
	}
}

func TestRemoveAllDeepTree(t *testing.T) {
	r, base := newRoot(t)
	if _, err := r.MkdirAll("vol", Owner{Mode: 0o755}, claimA); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "vol")
	for i := 0; i < 300; i++ {
		if err := os.WriteFile(filepath.Join(dir, "f"+string(rune('a'+i%26))+string(rune('a'+i/26))), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	deep := filepath.Join(dir, "a/b/c/d")
	if err := os.MkdirAll(deep, 0o500); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(dir, "a"), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.RemoveAll("vol"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("volume still there: %v", err)
	}
}

// A mount inside a volume (a pod's bind mount, or one a tenant arranged) stops the removal:
// crossing it could delete data that is not the volume's.
func TestRemoveAllStopsAtMountPoints(t *testing.T) {
	r, base := newRoot(t)
	if _, err := r.MkdirAll("vol/mnt", Owner{Mode: 0o755}, claimA); err != nil {
		t.Fatal(err)
	}
	other := t.TempDir()
	if err := os.WriteFile(filepath.Join(other, "data"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(base, "vol/mnt")
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, ""); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(mnt, "data"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := r.RemoveAll("vol"); err == nil {
		t.Fatal("RemoveAll crossed a mount point")
	}
	if _, err := os.Stat(filepath.Join(mnt, "data")); err != nil {
		t.Errorf("file on the other file system was removed: %v", err)
	}

	// A bind mount of a directory on the same file system is a mount point too.
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := r.MkdirAll("other", Owner{Mode: 0o755}, claimA); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(base, "other/keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
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

func TestAvailableIsTheBaseFileSystemsFreeSpace(t *testing.T) {
	base := t.TempDir()
	if err := unix.Mount("tmpfs", base, "tmpfs", 0, "size=8m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(base, unix.MNT_DETACH) })
	r, err := OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	before, err := r.Available()
	if err != nil {
		t.Fatal(err)
	}
	if before > 8<<20 || before < 7<<20 {
		t.Fatalf("Available of an empty 8 MiB tmpfs = %d", before)
	}
	if err := os.WriteFile(filepath.Join(base, "data"), make([]byte, 2<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	after, err := r.Available()
	if err != nil {
		t.Fatal(err)
	}
	if got := before - after; got != 2<<20 {
		t.Errorf("Available dropped by %d after a 2 MiB write, want %d", got, 2<<20)
	}
}

func TestMovedAfterAMountOverTheBase(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base")
	if err := os.Mkdir(base, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink(base, link); err != nil {
		t.Fatal(err)
	}
	r, err := OpenRoot(link)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if moved, err := r.Moved(); err != nil || moved {
		t.Fatalf("Moved of a base reached through a symlink, unchanged = %v, %v; want false", moved, err)
	}
	if err := unix.Mount("tmpfs", base, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(base, unix.MNT_DETACH) })
	if moved, err := r.Moved(); err != nil || !moved {
		t.Errorf("Moved after a file system was mounted on the base = %v, %v; want true", moved, err)
	}
}
