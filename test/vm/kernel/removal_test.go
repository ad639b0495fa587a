package kernel

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
)

// A removal reads directories a batch at a time and goes on from directory offsets, which on
// the kernel NFS client are server cookies: a tree whose directories hold several batches of
// names, and subdirectories between them, is removed whole through a real NFS mount.
func TestRemoveAllInBatchesOverNFS(t *testing.T) {
	for _, vers := range []string{"nfsvers=3", "nfsvers=4.2"} {
		t.Run(vers, func(t *testing.T) {
			options := []string{vers}
			serverDir, share := exportFor(t, options, guest.NoRootSquash)
			const files, dirs, perDir = 2600, 4, 1300
			if err := os.MkdirAll(filepath.Join(serverDir, "vol"), 0o755); err != nil {
				t.Fatal(err)
			}
			for i := range files {
				if err := os.WriteFile(filepath.Join(serverDir, "vol", "f"+strconv.Itoa(i)), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			for d := range dirs {
				dir := filepath.Join(serverDir, "vol", "d"+strconv.Itoa(d), "deeper")
				if err := os.MkdirAll(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				for i := range perDir {
					if err := os.WriteFile(filepath.Join(dir, "f"+strconv.Itoa(i)), nil, 0o644); err != nil {
						t.Fatal(err)
					}
				}
			}
			target := t.TempDir()
			m := mount.New("")
			if err := m.Mount(guest.NFSAddr+":"+share, target, "nfs", options); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
					t.Errorf("unmount %s: %v", target, err)
				}
			})
			r, err := volume.OpenRoot(target)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			if err := r.RemoveAll("vol"); err != nil {
				t.Fatalf("RemoveAll over NFS: %v", err)
			}
			if _, err := os.Lstat(filepath.Join(serverDir, "vol")); !errors.Is(err, os.ErrNotExist) {
				left, _ := os.ReadDir(filepath.Join(serverDir, "vol"))
				t.Errorf("vol on the server after RemoveAll: %v, %d entries left", err, len(left))
			}
		})
	}
}
