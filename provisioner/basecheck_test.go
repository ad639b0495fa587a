package provisioner

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
)

// waitEvent waits for an event that starts with prefix and says each of substrs, passing over
// others, and fails the test if none comes within 10 s.
func waitEvent(t *testing.T, events *record.FakeRecorder, prefix string, substrs ...string) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case e := <-events.Events:
			if strings.HasPrefix(e, prefix) && !slices.ContainsFunc(substrs, func(s string) bool { return !strings.Contains(e, s) }) {
				return
			}
		case <-timeout:
			t.Fatalf("no event %q saying %q", prefix, substrs)
		}
	}
}

// diskAt makes the directory rel beneath the fixture's base, on which mount bind-mounts a
// "disk" (a directory of the same file system: a mount point all the same, which a comparison
// of device numbers would miss) and unmount takes it away lazily, as an admin would have to
// while the provisioner holds the base open. A disk still mounted is unmounted after the test.
func (f *fixture) diskAt(t *testing.T, rel string) (disk, mnt string, mount, unmount func()) {
	t.Helper()
	disk, mnt = t.TempDir(), filepath.Join(f.base, rel)
	must(t, os.Mkdir(mnt, 0o755))
	mounted := false
	mount = func() {
		t.Helper()
		if err := unix.Mount(disk, mnt, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("mount the disk on %s: %v", mnt, err)
		}
		mounted = true
	}
	unmount = func() {
		t.Helper()
		must(t, unix.Unmount(mnt, unix.MNT_DETACH))
		mounted = false
	}
	t.Cleanup(func() {
		if mounted {
			f.node.locals.Close()
			unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	return disk, mnt, mount, unmount
}

// The disk under a local base does not mount (after a reboot, say): the path leads to the
// directory underneath. A new claim is refused there, not rescheduled, with an error that
// names the node and says what is wrong, and nothing is made underneath, nor the base itself
// where it lay beneath the disk's mount point; the node publishes no capacity for it; the
// Delete of a volume on the disk fails instead of finding nothing and succeeding. Once the
// disk is back, both go through, on the same Provisioner. The disk is a bind mount of the
// same file system; the BaseFileSystemChanged warnings on claim and PV, test/integration's
// TestBaseWhoseDiskIsGoneIsRefused checks with a disk of its own.
func TestLocalBaseWhoseDiskIsGoneIsRefused(t *testing.T) {
	for name, tc := range map[string]struct{ mountAt, basePath string }{
		"base at the disk's mount point":      {"data", "data"},
		"base beneath the disk's mount point": {"mnt", "mnt/fast"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			disk, mnt, mount, unmount := f.diskAt(t, tc.mountAt)
			mount()
			class := f.localClass(map[string]string{"basePath": filepath.Join(f.base, tc.basePath)})
			ctx := context.Background()
			pv, _, err := f.node.Provision(ctx, opts(class, claim("a")))
			must(t, err)
			onDisk := filepath.Join(disk, strings.TrimPrefix(tc.basePath, tc.mountAt), pv.Spec.CSI.VolumeAttributes["path"])
			if _, err := os.Stat(onDisk); err != nil {
				t.Fatalf("volume on the disk: %v", err)
			}

			unmount()
			_, state, err := f.node.Provision(ctx, opts(class, claim("b")))
			if !errors.Is(err, volume.ErrBaseChanged) || state != controller.ProvisioningFinished {
				t.Fatalf("Provision with the disk gone = %s, %v; want Finished (the claim waits here) and ErrBaseChanged", state, err)
			}
			if !strings.Contains(err.Error(), "node "+testNode) || !strings.Contains(err.Error(), "not mounted") {
				t.Errorf("error %q does not name the node or say what is wrong", err)
			}
			if got := listTree(t, mnt); len(got) != 0 {
				t.Errorf("the directory underneath the disk holds %v, want nothing", got)
			}
			resp, err := f.node.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: class.Parameters})
			if err != nil || resp.AvailableCapacity != 0 {
				t.Errorf("capacity with the disk gone = %v, %v; want 0", resp, err)
			}

			if err := f.node.Delete(ctx, pv); !errors.Is(err, volume.ErrBaseChanged) {
				t.Errorf("Delete with the disk gone = %v, want ErrBaseChanged", err)
			}
			if _, err := os.Stat(onDisk); err != nil {
				t.Fatalf("volume on the disk after the refused Delete: %v", err)
			}

			mount()
			if _, _, err := f.node.Provision(ctx, opts(class, claim("b"))); err != nil {
				t.Errorf("Provision with the disk back: %v", err)
			}
			if err := f.node.Delete(ctx, pv); err != nil {
				t.Errorf("Delete with the disk back: %v", err)
			}
			if _, err := os.Stat(onDisk); !os.IsNotExist(err) {
				t.Errorf("volume on the disk after Delete: %v, want it gone", err)
			}
		})
	}
}
