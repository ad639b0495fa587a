package volume

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// newRoot opens a Root on a new temporary directory for the test's lifetime.
func newRoot(t *testing.T) (*Root, string) {
	base := t.TempDir()
	return rootAt(t, base), base
}

// rootAt opens a Root on dir for the test's lifetime.
func rootAt(t *testing.T, dir string) *Root {
	t.Helper()
	r, err := OpenRoot(dir)
	must(t, err)
	t.Cleanup(func() { r.Close() })
	return r
}

// mkVolume makes claim's volume rel in r, failing the test if it cannot.
func mkVolume(t *testing.T, r *Root, rel string, owner Owner, claim Claim) {
	t.Helper()
	if _, err := r.MkdirAll(rel, owner, claim); err != nil {
		t.Fatal(err)
	}
}

// absent fails the test unless nothing is at p; what says what it would be.
func absent(t *testing.T, p, what string) {
	t.Helper()
	if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s: %s: %v, want nothing there", what, p, err)
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
	must(t, os.WriteFile(secret, []byte("keep"), 0o600))
	// "ns" is a symlink to a directory outside the base.
	must(t, os.Symlink(outside, filepath.Join(base, "ns")))
	if _, err := r.MkdirAll("ns/vol", Owner{Mode: 0o755}, claimA); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("MkdirAll through a symlink: err = %v, want ErrNotDirectory", err)
	}
	absent(t, filepath.Join(outside, "vol"), "MkdirAll created a directory outside the base")
	if err := r.RemoveAll("ns/secret"); err == nil {
		t.Errorf("RemoveAll through a symlinked parent succeeded")
	}
	if err := renameVolume(r, "ns/secret", "x"); err == nil {
		t.Errorf("Rename through a symlinked parent succeeded")
	}
	if _, err := r.OpenDir("ns"); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("OpenDir of a symlink: err = %v, want ErrNotDirectory", err)
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "keep" {
		t.Errorf("target outside the base changed: %q, %v", b, err)
	}
}

func TestMovedAfterAMountOverTheBase(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base")
	must(t, os.Mkdir(base, 0o755))
	link := filepath.Join(dir, "link")
	must(t, os.Symlink(base, link))
	r := rootAt(t, link)
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
	must(t, err)
	d, err := r.Dup()
	must(t, err)
	defer d.Close()
	r.Close()
	if _, err := d.MkdirAll("vol", Owner{Mode: 0o755}, Claim{UID: "uid-vol", PVName: "pv-vol"}); err != nil {
		t.Fatalf("MkdirAll on the duplicate after the original closed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(base, "vol")); err != nil {
		t.Errorf("directory made through the duplicate is not in the base: %v", err)
	}
}
