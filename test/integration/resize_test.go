package integration

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// btrfsClass creates a local class whose base is a btrfs file system with quota on, mounted
// (bound) inside node-a's allowed bases, and returns it, its base, and where else the file
// system is mounted (to reach it while the base is not).
func btrfsClass(t *testing.T, params map[string]string, opts ...framework.ClassOption) (class, base, disk string) {
	t.Helper()
	mnt := quotatest.Btrfs(t, true)
	c, base := localClass(t, params, opts...)
	must(t, os.MkdirAll(base, 0o755))
	if err := unix.Mount(mnt, base, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind %s on %s: %v", mnt, base, err)
	}
	// The node keeps its bases open: detached, the bind mount goes once it lets go, while the
	// file system's own mount point can go at once.
	t.Cleanup(func() { unix.Unmount(base, unix.MNT_DETACH) })
	// The disk is this run's own: the next run (-count) mounts a fresh one at the same base,
	// which node-a would refuse as a disk that did not mount while it remembers this one. The
	// admin who retires a base removes its record; so does the test (node-a's state dir is the
	// directory of its CSI socket, the workspace).
	t.Cleanup(func() {
		os.Remove(volume.NewBaseRecords(filepath.Join(suite.Work.Dir, "bases")).RecordPath(base))
	})
	return c.Name, base, mnt
}

// setClaimSize sets the claim's storage request, as `kubectl edit` would.
func setClaimSize(ctx context.Context, ns, name, size string) error {
	return framework.SetClaimSize(ctx, suite.Client, ns, name, size)
}

// waitResized waits until the claim and its PV report size and no resize is in progress.
func waitResized(t *testing.T, ns, name, size string) *v1.PersistentVolumeClaim {
	t.Helper()
	pvc, err := framework.WaitForClaimResized(context.Background(), suite.Client, ns, name, size, timeout)
	if err != nil {
		t.Fatalf("%v\n--- events: %s\n--- node-a log tail:\n%s", err,
			framework.EventsOf(context.Background(), suite.Client, ns, "PersistentVolumeClaim", name), nodeProc.Tail(3000))
	}
	return pvc
}

// A bound 16Mi claim on a btrfs base is asked to grow beyond the base's free space: that is
// refused as infeasible, with an event, and the PV keeps its size; the user lowers the request
// to a size that fits, which is accepted, and a process that keeps its file open, stopped at
// the old limit, writes past it; the API server refuses a shrink. (Growing a claim under a
// running pod: test/vm/node's TestQuotaClaimOnGuestDisk, on XFS and ext4.)
func TestLocalClaimExpandsOnline(t *testing.T) {
	ns := suite.NewNamespace(t)
	class, base, _ := btrfsClass(t, map[string]string{"capacityEnforcement": "required"}, framework.AllowVolumeExpansion)
	ctx := context.Background()
	suite.CreateClaim(t, ns, "data", class, framework.OnNode(nodeA), framework.Request("16Mi"))
	_, pv := waitBound(t, ns, "data")
	if pv.Spec.CSI.VolumeAttributes["quota"] == "" {
		t.Fatalf("PV attributes %v name no quota", pv.Spec.CSI.VolumeAttributes)
	}

	f, err := os.Create(filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"], "data"))
	must(t, err)
	defer f.Close()
	if n, err := quotatest.WriteFull(f, 32<<20); !errors.Is(err, unix.EDQUOT) || n > 16<<20 {
		t.Fatalf("writing 32 MiB into a 16Mi claim: %d bytes went in, err %v; want EDQUOT within 16 MiB", n, err)
	}
	// btrfs frees what the refused write reserved at commit.
	unix.Sync()

	// Far beyond what the 256 MiB file system has free.
	must(t, setClaimSize(ctx, ns, "data", "1Gi"))
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		pvc, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		got := pvc.Status.AllocatedResourceStatuses[v1.ResourceStorage]
		return got == v1.PersistentVolumeClaimControllerResizeInfeasible, fmt.Errorf("allocatedResourceStatuses %v, conditions %+v", pvc.Status.AllocatedResourceStatuses, pvc.Status.Conditions)
	})
	if err != nil {
		t.Fatalf("resize beyond the free space: want %s: %v", v1.PersistentVolumeClaimControllerResizeInfeasible, err)
	}
	waitEvent(t, ns, "PersistentVolumeClaim", "data", "VolumeResizeFailed", "not enough free space")
	if pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{}); err != nil || pv.Spec.Capacity.Storage().String() != "16Mi" {
		t.Errorf("PV capacity after an infeasible resize: %v (%v), want 16Mi", pv.Spec.Capacity, err)
	}

	// RecoverVolumeExpansionFailure: the user asks for less, still more than the claim has.
	must(t, setClaimSize(ctx, ns, "data", "48Mi"))
	waitResized(t, ns, "data", "48Mi")
	if n, err := quotatest.WriteFull(f, 12<<20); err != nil {
		t.Errorf("after the resize to 48Mi, %d of 12 more MiB went in: %v", n, err)
	}
	err = setClaimSize(ctx, ns, "data", "16Mi")
	if !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "can not be less than status.capacity") {
		t.Errorf("shrinking the claim back to 16Mi: %v, want the API server's Invalid: can not be less than status.capacity", err)
	}
}

// An NFS claim's resize is recorded: the claim and its PV report the new size (NFS sizes are
// not enforced, so there is no limit to raise).
func TestNFSClaimResizeIsRecorded(t *testing.T) {
	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, []string{"nolock"}, nil, framework.AllowVolumeExpansion)
	suite.CreateClaim(t, ns, "shared", class.Name, framework.AccessModes(v1.ReadWriteMany))
	waitBound(t, ns, "shared")
	must(t, setClaimSize(context.Background(), ns, "shared", "2Gi"))
	waitResized(t, ns, "shared", "2Gi")
}
