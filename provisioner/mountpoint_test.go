package provisioner

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
)

// A class says its base path must be a mount point, and the disk meant to be mounted there is
// not, from the base's very first use on the node (where no record of its identity exists to
// compare with): a claim is refused, not rescheduled, with an error that names the node and
// says what to do. Once the disk is mounted the claim goes through; once it is gone again, the
// Delete of its volume is refused the same way and leaves the data alone, and goes through when
// the disk is back. The disk is diskAt's bind mount. With a disk of its own
// (btrfs on a loop device), test/integration's TestBaseThatMustBeAMountPointWaitsForItsDisk
// shows the rest through a real apiserver: the BasePathNotMounted warnings on claim and PV,
// nothing made underneath, no record adopting it, no room published until the disk is there.
func TestBasePathThatMustBeAMountPoint(t *testing.T) {
	f := newFixture(t)
	disk, mnt, mount, unmount := f.diskAt(t, "disk")
	class := f.localClass(map[string]string{ParamBasePath: mnt, ParamBasePathMountPoint: string(MountPointRequired)})
	ctx := context.Background()
	refused := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, volume.ErrBaseChanged) {
			t.Fatalf("%s while the disk is not mounted = %v, want a refusal", what, err)
		}
		for _, want := range []string{"node " + testNode, mnt, "must be a mount point", "mount the disk"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error %q does not say %q", what, err, want)
			}
		}
	}

	_, state, err := f.node.Provision(ctx, opts(class, claim("a")))
	refused("Provision", err)
	if state != controller.ProvisioningFinished {
		t.Errorf("Provision state %s, want Finished: the claim waits for the disk here", state)
	}

	mount()
	pv, _, err := f.node.Provision(ctx, opts(class, claim("a")))
	if err != nil {
		t.Fatalf("Provision with the disk mounted: %v", err)
	}
	if got := pv.Annotations[AnnBasePathMountPoint]; got != string(MountPointRequired) {
		t.Errorf("PV annotation %s = %q, want %q, so that Delete checks without the class", AnnBasePathMountPoint, got, MountPointRequired)
	}
	// A form of PV of its own, held like the others (formats_test.go); the Delete below acts
	// on the stored form.
	pv = checkPVFormat(t, pv, goldenBase+"/disk", filepath.Join("testdata", "formats", "pv-local-mount-point-v1.json"))
	onDisk := filepath.Join(disk, pv.Spec.CSI.VolumeAttributes["path"])
	if err := os.WriteFile(filepath.Join(onDisk, "data"), []byte("kept"), 0o644); err != nil {
		t.Fatalf("volume on the disk: %v", err)
	}

	unmount()
	refused("Delete", f.node.Delete(ctx, pv))
	if b, err := os.ReadFile(filepath.Join(onDisk, "data")); err != nil || string(b) != "kept" {
		t.Errorf("the volume's data after the refused Delete: %q, %v", b, err)
	}

	mount()
	if err := f.node.Delete(ctx, pv); err != nil {
		t.Errorf("Delete with the disk back: %v", err)
	}
	if _, err := os.Stat(onDisk); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume on the disk after Delete: %v, want it gone", err)
	}
}

// Where the base path must be a mount point and does not exist at all (the disk was to be
// mounted on a directory that a reinstall did not recreate, say), it is not created; the
// allowed base itself is refused as such a base, since in the node plugin's pod it is always a
// mount point (a hostPath volume); a class that does not ask keeps today's behaviour.
func TestBasePathMountPointRefusals(t *testing.T) {
	for name, tc := range map[string]struct {
		basePath, mountPoint, want string // basePath beneath the allowed base; want "": provisioned
	}{
		"missing base path":   {"disk/fast", string(MountPointRequired), "does not exist"},
		"allowed base itself": {"", string(MountPointRequired), "allowed base path itself"},
		"optional":            {"plain", string(MountPointOptional), ""},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			class := f.localClass(map[string]string{ParamBasePath: filepath.Join(f.base, tc.basePath), ParamBasePathMountPoint: tc.mountPoint})
			pv, _, err := f.node.Provision(context.Background(), opts(class, claim("a")))
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Provision on a plain directory of a class that does not require a mount point: %v", err)
				}
				if _, ok := pv.Annotations[AnnBasePathMountPoint]; ok {
					t.Errorf("PV annotations %v, want no %s", pv.Annotations, AnnBasePathMountPoint)
				}
				return
			}
			if !errors.Is(err, volume.ErrBaseChanged) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Provision = %v, want a refusal saying %q", err, tc.want)
			}
			if got := listTree(t, f.base); len(got) != 0 {
				t.Errorf("allowed base holds %v, want nothing", got)
			}
		})
	}
}
