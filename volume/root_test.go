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
