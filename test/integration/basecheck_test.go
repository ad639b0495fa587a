package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/internal/daemon"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// The disk under a local base goes away under the running node plugin, as after a reboot where
// it did not mount: a btrfs file system on a loop device, unmounted from the base. A new claim
// then gets a BaseFileSystemChanged warning naming the node, and nothing is created in the
// directory underneath (where it would be hidden once the disk is back); deleting a claim
// whose volume is on the disk does not delete its PV, nor touch its data, instead of finding
// nothing and succeeding. Once the disk is mounted again, both go through by themselves,
// without a restart of the plugin.
func TestBaseWhoseDiskIsGoneIsRefused(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, base, disk := btrfsClass(t, nil)
	suite.CreateClaim(t, ns, "first", class, framework.OnNode(nodeA), framework.Request("16Mi"))
	_, pv := waitBound(t, ns, "first")
	rel := pv.Spec.CSI.VolumeAttributes["path"]
	must(t, os.WriteFile(filepath.Join(base, rel, "data"), []byte("kept"), 0o644))

	// The node plugin holds the base open: the unmount is lazy, as an admin's would have to be.
	if err := unix.Unmount(base, 0); errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(base, unix.MNT_DETACH)
		if err != nil {
			t.Fatalf("unmount %s: %v", base, err)
		}
	} else if err != nil {
		t.Fatalf("unmount %s: %v", base, err)
	}
	suite.CreateClaim(t, ns, "second", class, framework.OnNode(nodeA), framework.Request("16Mi"))
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "second", provisioner.ReasonBaseFileSystemChanged, "not mounted", nodeProc)
	if ev.Type != v1.EventTypeWarning || !strings.Contains(ev.Message, "node "+nodeA) || !strings.Contains(ev.Message, base) {
		t.Errorf("event %s %q: want a Warning naming node %s and base %s", ev.Type, ev.Message, nodeA, base)
	}
	if got := entries(t, base); len(got) != 0 {
		t.Errorf("the directory underneath the disk holds %v, want nothing", got)
	}

	deleteWaitsForDisk(t, ns, "first", pv.Name, provisioner.ReasonBaseFileSystemChanged, "not mounted", filepath.Join(disk, rel, "data"))
	if c := getClaim(t, ns, "second"); c.Status.Phase != v1.ClaimPending {
		t.Errorf("claim second while the disk is away: %v, want Pending", c.Status.Phase)
	}

	if err := unix.Mount(disk, base, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("mount the disk on %s again: %v", base, err)
	}
	_, second := waitBound(t, ns, "second")
	if _, err := os.Stat(filepath.Join(disk, second.Spec.CSI.VolumeAttributes["path"])); err != nil {
		t.Errorf("the second claim's volume is not on the disk: %v", err)
	}
	must(t, framework.WaitForPVDeleted(ctx, suite.Client, pv.Name, timeout), nodeProc)
	if _, err := os.Stat(filepath.Join(disk, rel)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the first claim's volume on the disk after its PV went: %v, want it removed", err)
	}
	deleteClaim(t, ns, "second")
	waitPVGone(t, second.Name)
}

// A class says that its base path must be a mount point, and the disk meant for it is not
// mounted from the start (a new node whose fstab misses the disk): the base is an empty
// directory of the root file system, which no record of the node knows yet and which would be
// adopted without the parameter. A claim gets a BasePathNotMounted warning naming the node and
// the base, and stays Pending; nothing is created underneath and nothing is adopted; the node
// publishes no room for the class. Once the disk (btrfs on a loop device) is mounted there, the
// claim binds without a restart of the plugin, its volume on the disk, and the node publishes
// the disk's room. With the disk gone again, deleting the claim leaves its PV
// Released with the same warning and its data on the disk alone; the disk back, the PV and
// the volume go.
func TestBaseThatMustBeAMountPointWaitsForItsDisk(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	disk := quotatest.Btrfs(t, false)
	c, base := localClass(t, map[string]string{provisioner.ParamBasePathMountPoint: string(provisioner.MountPointRequired)})
	must(t, os.MkdirAll(base, 0o755))
	record := volume.NewBaseRecords(filepath.Join(suite.Work.Dir, "bases")).RecordPath(base)
	t.Cleanup(func() {
		unix.Unmount(base, unix.MNT_DETACH)
		os.Remove(record)
	})
	mount := func() {
		t.Helper()
		if err := unix.Mount(disk, base, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("mount the disk on %s: %v", base, err)
		}
	}
	notMounted := func(kind, name string) {
		t.Helper()
		ev := waitEvent(t, ns, kind, name, provisioner.ReasonBasePathNotMounted, "must be a mount point", nodeProc)
		if ev.Type != v1.EventTypeWarning || !strings.Contains(ev.Message, "node "+nodeA) || !strings.Contains(ev.Message, base) {
			t.Errorf("event %s %q: want a Warning naming node %s and base %s", ev.Type, ev.Message, nodeA, base)
		}
		if got := entries(t, base); len(got) != 0 {
			t.Errorf("the directory underneath the disk holds %v, want nothing", got)
		}
	}

	suite.CreateClaim(t, ns, "data", c.Name, framework.OnNode(nodeA), framework.Request("16Mi"))
	notMounted("PersistentVolumeClaim", "data")
	if _, err := os.Stat(record); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("node-a's record of base %s: %v, want none: the directory underneath must not be adopted", base, err)
	}
	if got := getClaim(t, ns, "data"); got.Status.Phase != v1.ClaimPending {
		t.Errorf("claim while the disk is not mounted: %v, want Pending", got.Status.Phase)
	}
	waitCapacity(t, daemon.DefaultNamespace, c.Name, "0 on "+nodeA+" while the disk is not mounted", func(m map[string]storagev1.CSIStorageCapacity) bool {
		o, ok := m[nodeA]
		return ok && bytesOf(o) == 0
	})

	mount()
	_, pv := waitBound(t, ns, "data")
	waitCapacity(t, daemon.DefaultNamespace, c.Name, "room on "+nodeA+" once the disk is mounted", func(m map[string]storagev1.CSIStorageCapacity) bool {
		o, ok := m[nodeA]
		return ok && bytesOf(o) > 0
	})
	rel := pv.Spec.CSI.VolumeAttributes["path"]
	if err := os.WriteFile(filepath.Join(disk, rel, "data"), []byte("kept"), 0o644); err != nil {
		t.Fatalf("the claim's volume on the disk: %v", err)
	}

	// The node plugin holds the base open: the unmount is lazy, as an admin's would have to be.
	if err := unix.Unmount(base, unix.MNT_DETACH); err != nil {
		t.Fatalf("unmount %s: %v", base, err)
	}
	deleteWaitsForDisk(t, ns, "data", pv.Name, provisioner.ReasonBasePathNotMounted, "must be a mount point", filepath.Join(disk, rel, "data"))
	if got := entries(t, base); len(got) != 0 {
		t.Errorf("the directory underneath the disk holds %v, want nothing", got)
	}

	mount()
	must(t, framework.WaitForPVDeleted(ctx, suite.Client, pv.Name, timeout), nodeProc)
	if _, err := os.Stat(filepath.Join(disk, rel)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the claim's volume on the disk after its PV went: %v, want it removed", err)
	}
}

// deleteWaitsForDisk deletes the claim whose volume's disk is away and checks that its Delete
// waits for the disk: the PV gets a Warning of reason mentioning msg and stays Released, and
// the file the claim wrote ("kept") is still on the disk at data.
func deleteWaitsForDisk(t *testing.T, ns, claim, pvName, reason, msg, data string) {
	t.Helper()
	ctx := context.Background()
	deleteClaim(t, ns, claim)
	waitEvent(t, "", "PersistentVolume", pvName, reason, msg, nodeProc)
	if got, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pvName, metav1.GetOptions{}); err != nil {
		t.Errorf("PV %s of the deleted claim while its disk is away: %v, want it kept until its volume is deleted", pvName, err)
	} else if got.Status.Phase != v1.VolumeReleased {
		t.Errorf("PV %s is %s, want Released", pvName, got.Status.Phase)
	}
	if b, err := os.ReadFile(data); err != nil || string(b) != "kept" {
		t.Errorf("claim %s's data on the disk: %q, %v", claim, b, err)
	}
}
