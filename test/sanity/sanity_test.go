package sanity

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// TestSanity runs the suite on the host with local volumes: real bind mounts from a base the
// node plugin allows.
func TestSanity(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the node plugin makes real bind mounts")
	}
	tmp := t.TempDir()
	base := filepath.Join(tmp, "base")
	if err := os.Mkdir(base, 0o755); err != nil {
		t.Fatal(err)
	}
	root, err := volume.OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	Run(t, Config{Dir: tmp, Volumes: root, LocalBases: []string{base}, FSTypes: []string{fsTypeOf(t, base)},
		Attributes: func(rel string) volume.Attributes {
			return volume.Attributes{Backend: volume.BackendLocal, BasePath: base, Path: rel}
		}})
}

// fsTypeOf is the type of the file system dir is on, which a bind mount of dir shows too.
func fsTypeOf(t *testing.T, dir string) string {
	t.Helper()
	infos, err := mount.ParseMountInfo("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var best mount.MountInfo
	for _, mi := range infos {
		if (dir == mi.MountPoint || strings.HasPrefix(dir, strings.TrimSuffix(mi.MountPoint, "/")+"/")) && len(mi.MountPoint) >= len(best.MountPoint) {
			best = mi
		}
	}
	return best.FsType
}
