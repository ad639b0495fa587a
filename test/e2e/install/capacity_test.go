package install

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// btrfsBase is a btrfs file system with quota on, mounted by beforeCluster beneath the node
// plugin's allowed base before dirpv is installed (the e2e overlay gives the plugin's base
// volume no mount propagation, so it must be there when the pod starts).
const btrfsBase = basePath + "/install-btrfs"

// capacityClass creates a local class on btrfsBase whose sizes must be enforced: a claim that
// got no limit would fail to provision, not pass unnoticed.
func capacityClass(t *testing.T, name string) {
	t.Helper()
	suite.CreateClass(t, name, map[string]string{"backend": "local", "basePath": btrfsBase, "capacityEnforcement": "required"})
}

// podDone waits for the pod to end and returns what it printed.
func podDone(t *testing.T, ns, name string) string {
	t.Helper()
	ctx := context.Background()
	pod, err := framework.WaitForPodPhase(ctx, suite.Client, ns, name, v1.PodSucceeded, timeout)
	if err != nil {
		t.Fatalf("%v\n%s", err, framework.EventsOf(ctx, suite.Client, ns, "Pod", name))
	}
	b, err := suite.Client.CoreV1().Pods(ns).GetLogs(pod.Name, &v1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		t.Fatalf("logs of %s/%s: %v", ns, name, err)
	}
	return string(b)
}

// dfTotalRe is the size column of `df -Pk`'s line for the mount: 1024-byte blocks.
var dfTotalRe = regexp.MustCompile(`(?m)^\S+\s+(\d+)\s+\d+\s+\d+\s+\d+%\s+/data$`)

// A pod writing 32Mi into its 16Mi claim is stopped at the claim's size with "Disk quota
// exceeded", and its neighbour on the same file system can still write. df in the pod shows
// the whole btrfs file system (btrfs's statfs knows nothing of qgroups): the claim's own
// figures are kubelet's (TestKubeletReportsClaimUsage).
func TestPodWritePastClaimSizeStopsAtLimit(t *testing.T) {
	ns := suite.NewNamespace(t)
	capacityClass(t, "install-capacity-limit")
	const size = 16 << 20
	suite.CreateClaim(t, ns, "small", "install-capacity-limit", framework.Request("16Mi"))
	suite.CreateClaim(t, ns, "neighbour", "install-capacity-limit", framework.Request("16Mi"))

	suite.CreatePod(t, suite.BusyboxPod(ns, "filler", "small",
		`dd if=/dev/urandom of=/data/big bs=1M count=32 conv=fsync 2>&1; echo "dd exit $?"; df -Pk /data`, false))
	logs := podDone(t, ns, "filler")
	if !strings.Contains(logs, "Disk quota exceeded") && !strings.Contains(logs, "No space left on device") {
		t.Errorf("writing 32Mi into a 16Mi claim: pod printed %q, want dd's Disk quota exceeded or No space left on device", logs)
	}
	if strings.Contains(logs, "dd exit 0") {
		t.Errorf("dd of 32Mi into a 16Mi claim succeeded: %q", logs)
	}
	pv, err := framework.WaitForBoundPV(context.Background(), suite.Client, ns, "small", timeout)
	must(t, err)
	if got := pv.Spec.Capacity[v1.ResourceStorage]; got.Cmp(resource.MustParse("16Mi")) != 0 {
		t.Errorf("PV capacity %s, want 16Mi", got.String())
	}
	st, err := os.Stat(filepath.Join(volumeDir(t, ns, "small"), "big"))
	must(t, err)
	t.Logf("the pod wrote %d bytes into its %d-byte claim; it printed:\n%s", st.Size(), size, logs)
	// What stops the write is the qgroup's count of the subvolume's data and tree blocks.
	if n := st.Size(); n > size || n < size-1<<20 {
		t.Errorf("the pod's file holds %d bytes, want the claim's size %d within 1 MiB below it", n, size)
	}

	m := dfTotalRe.FindStringSubmatch(logs)
	if m == nil {
		t.Fatalf("no df line for /data in %q", logs)
	}
	dfKiB, _ := strconv.ParseUint(m[1], 10, 64)
	var sfs unix.Statfs_t
	must(t, unix.Statfs(btrfsBase, &sfs))
	// btrfs's size in statfs moves a little as it allocates chunks.
	if fsKiB := sfs.Blocks * uint64(sfs.Bsize) / 1024; dfKiB < fsKiB*9/10 || dfKiB > fsKiB*11/10 {
		t.Errorf("df in the pod shows %d KiB, want the btrfs file system's %d KiB (within 10%%)", dfKiB, fsKiB)
	}

	suite.CreatePod(t, suite.BusyboxPod(ns, "next-door", "neighbour",
		`dd if=/dev/urandom of=/data/f bs=1M count=8 conv=fsync 2>&1 && echo neighbour-wrote`, false))
	if logs := podDone(t, ns, "next-door"); !strings.Contains(logs, "neighbour-wrote") {
		t.Errorf("neighbour claim's pod: %q, want 8Mi written", logs)
	}
	if st, err := os.Stat(filepath.Join(volumeDir(t, ns, "neighbour"), "f")); err != nil || st.Size() != 8<<20 {
		t.Errorf("neighbour's file: %v, %v; want 8 MiB", st, err)
	}
}

// kubelet's figures for a claim (its stats summary, and so kubelet_volume_stats_*) are the
// claim's own: capacity its size, usage what its pod wrote, not the file system's.
func TestKubeletReportsClaimUsage(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	capacityClass(t, "install-capacity-stats")
	const size, written = 64 << 20, 32 << 20
	suite.CreateClaim(t, ns, "half", "install-capacity-stats", framework.Request("64Mi"))
	suite.CreatePod(t, suite.BusyboxPod(ns, "writer", "half",
		`dd if=/dev/urandom of=/data/f bs=1M count=32 conv=fsync && sync && echo written && sleep 3600`, false))
	waitRunning(t, ns, "writer")

	const tolerance = 1 << 20
	var last string
	// btrfs counts qgroups at transaction commit and kubelet refreshes its figures every
	// 10-20 s here (volumeStatsAggPeriod): poll.
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		vs, err := framework.KubeletVolumeStats(ctx, suite.Client, suite.Cluster.NodeName, ns, "half")
		if err != nil {
			return false, err
		}
		if vs == nil || vs.CapacityBytes == nil || vs.UsedBytes == nil || vs.AvailableBytes == nil {
			return false, fmt.Errorf("kubelet has no figures for the claim yet: %+v", vs)
		}
		c, u, a := *vs.CapacityBytes, *vs.UsedBytes, *vs.AvailableBytes
		last = fmt.Sprintf("capacity %d, used %d, available %d", c, u, a)
		near := func(v, want uint64) bool { return v+tolerance >= want && v <= want+tolerance }
		return c == size && near(u, written) && near(a, size-written), fmt.Errorf("kubelet reports %s", last)
	})
	if err != nil {
		t.Fatalf("kubelet's stats of a %d-byte claim holding %d bytes: %v; want them within %d bytes\n%s",
			size, written, err, tolerance, podLogsOrErr(ns, "writer"))
	}
	t.Logf("kubelet's stats of the claim: %s", last)
}

func podLogsOrErr(ns, name string) string {
	b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &v1.PodLogOptions{}).DoRaw(context.Background())
	if err != nil {
		return err.Error()
	}
	return "pod logs: " + string(b)
}

// waitLogContains waits until the pod's log, as `kubectl logs` shows it, holds substr ("":
// anything at all) and returns the log.
func waitLogContains(t *testing.T, ns, name, substr string) string {
	t.Helper()
	var logs string
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &v1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			return false, err
		}
		logs = string(b)
		return logs != "" && strings.Contains(logs, substr), fmt.Errorf("no %q in the log yet", substr)
	})
	if err != nil {
		t.Fatalf("pod %s/%s: %v; log:\n%s\n%s", ns, name, err, logs, framework.EventsOf(context.Background(), suite.Client, ns, "Pod", name))
	}
	return logs
}

// A disk an admin mounts beneath /var/lib/dirpv while dirpv's node pod runs reaches the pod
// (HostToContainer from a shared mount, as on real nodes): a class on it that requires sizes
// enforced gets the disk's room published, its pod is scheduled and writes to the disk, not
// to the empty directory under it, with the claim's limit.
func TestDiskMountedUnderRunningPluginIsUsed(t *testing.T) {
	ns := suite.NewNamespace(t)
	late := basePath + "/install-late-disk"
	must(t, os.MkdirAll(late, 0o755))
	disk, err := quotatest.MountBtrfs(filepath.Join(suite.Work.Dir, "btrfs-late.img"), late, 1<<30, true)
	must(t, err)
	t.Cleanup(func() {
		// dirpv's node plugin holds its bases open, as it would a real disk's.
		if err := disk.Detach(); err != nil {
			t.Errorf("remove the late disk: %v", err)
		}
		os.Remove(late)
	})
	suite.CreateClass(t, "install-late-disk", map[string]string{"backend": "local", "basePath": late, "capacityEnforcement": "required"})
	suite.CreateClaim(t, ns, "c", "install-late-disk", framework.Request("16Mi"))
	// Before the disk goes: the volume is removed from it, not from the directory under it.
	t.Cleanup(func() { deletePodAndClaim(t, ns, "writer", "c") })
	suite.CreatePod(t, suite.BusyboxPod(ns, "writer", "c", `echo on-the-disk > /data/f && sync && echo wrote`, false))
	if logs := podDone(t, ns, "writer"); !strings.Contains(logs, "wrote") {
		t.Fatalf("pod printed %q", logs)
	}
	pv, err := framework.WaitForBoundPV(context.Background(), suite.Client, ns, "c", timeout)
	must(t, err)
	if q := pv.Spec.CSI.VolumeAttributes["quota"]; !strings.HasPrefix(q, "btrfs/") {
		t.Errorf("PV quota attribute %q, want the btrfs qgroup of the mounted disk", q)
	}
	dir := volumeDir(t, ns, "c")
	if b, err := os.ReadFile(filepath.Join(dir, "f")); err != nil || string(b) != "on-the-disk\n" {
		t.Errorf("the pod's file on the host: %q, %v", b, err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil || uint32(sfs.Type) != unix.BTRFS_SUPER_MAGIC {
		t.Errorf("volume directory %s is on file system type %#x (%v), want the mounted btrfs", dir, sfs.Type, err)
	}
}
