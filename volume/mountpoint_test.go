package volume

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// What counts as a mount point is what the mount table says, not what device numbers say: a
// btrfs subvolume has a device number of its own but is no mount point, a bind mount of a
// directory of the same file system has its parent's but is one, and so is a file system's
// own mount point and a subvolume mounted elsewhere. A root opened before a mount keeps
// answering for the directory it holds, which SameDirectory tells apart from the mounted one.
func TestIsMountPoint(t *testing.T) {
	fs := quotatest.Btrfs(t, false)
	sub := filepath.Join(fs, "sub")
	if out, err := exec.Command("btrfs", "subvolume", "create", sub).CombinedOutput(); err != nil {
		t.Fatalf("btrfs subvolume create: %v: %s", err, out)
	}
	var fsStat, subStat unix.Stat_t
	must(t, unix.Stat(fs, &fsStat))
	must(t, unix.Stat(sub, &subStat))
	if fsStat.Dev == subStat.Dev {
		t.Fatalf("btrfs subvolume %s has its file system's device number: this test's premise does not hold", sub)
	}
	dir := t.TempDir()
	plain := filepath.Join(dir, "plain")
	bound := filepath.Join(dir, "bound")
	subMounted := filepath.Join(dir, "sub-mounted")
	for _, d := range []string{plain, bound, subMounted, filepath.Join(dir, "src")} {
		must(t, os.Mkdir(d, 0o755))
	}
	before := rootAt(t, bound)
	for _, m := range [][2]string{{filepath.Join(dir, "src"), bound}, {sub, subMounted}} {
		if err := unix.Mount(m[0], m[1], "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("bind %s on %s: %v", m[0], m[1], err)
		}
		t.Cleanup(func() { unix.Unmount(m[1], unix.MNT_DETACH) })
	}

	for path, want := range map[string]bool{
		plain:      false,
		sub:        false,
		fs:         true,
		bound:      true,
		subMounted: true,
	} {
		r, err := OpenRoot(path)
		must(t, err)
		got, err := r.IsMountPoint()
		r.Close()
		if err != nil || got != want {
			t.Errorf("IsMountPoint(%s) = %v, %v; want %v", path, got, err, want)
		}
	}
	if got, err := before.IsMountPoint(); err != nil || got {
		t.Errorf("IsMountPoint of %s opened before the mount = %v, %v; want false: it holds the directory underneath", bound, got, err)
	}
	now := rootAt(t, bound)
	if same, err := before.SameDirectory(now); err != nil || same {
		t.Errorf("SameDirectory of %s before and after the mount = %v, %v; want false", bound, same, err)
	}
	again := rootAt(t, bound)
	if same, err := now.SameDirectory(again); err != nil || !same {
		t.Errorf("SameDirectory of %s opened twice = %v, %v; want true", bound, same, err)
	}
}
