package kernel

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/dirpv/dirpv/test/vm/guest"
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
			must(t, os.MkdirAll(filepath.Join(serverDir, "vol"), 0o755))
			for i := range files {
				must(t, os.WriteFile(filepath.Join(serverDir, "vol", "f"+strconv.Itoa(i)), nil, 0o644))
			}
			for d := range dirs {
				dir := filepath.Join(serverDir, "vol", "d"+strconv.Itoa(d), "deeper")
				must(t, os.MkdirAll(dir, 0o755))
				for i := range perDir {
					must(t, os.WriteFile(filepath.Join(dir, "f"+strconv.Itoa(i)), nil, 0o644))
				}
			}
			r := openExport(t, share, options)
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
