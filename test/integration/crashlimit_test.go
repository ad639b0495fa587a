package integration

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// A node instance whose base is btrfs with quota on dies (SIGKILL, at a failpoint, so that the
// crash is in the window and nowhere else) after it made a claim's subvolume under its
// temporary name and before it set the limit, or after the limit and before the rename. After
// a restart the claim binds to a volume whose limit is in place (a write past the claim's size
// fails), nothing is left under a temporary name, and the file system holds exactly one qgroup
// per volume: none leaked, also once the claim is deleted.
func TestCrashBetweenMkdirAndLimit(t *testing.T) {
	for _, point := range []string{failpoint.BeforeLimit, failpoint.BeforeRename} {
		t.Run(point, func(t *testing.T) { testCrashAt(t, point) })
	}
}

func testCrashAt(t *testing.T, point string) {
	const size = 16 << 20 // the claim's request
	node := "node-crash-" + point
	mnt := quotatest.Btrfs(t, true)
	before := quotatest.Qgroups(t, mnt)

	// After the file system, so that its cleanup (unmount) comes after the instance's stop.
	proc := startNodeInstance(t, node, mnt, failpoint.Env+"="+point)

	ns := suite.NewNamespace(t)
	class := suite.CreateClass(t, "crash-"+point, map[string]string{
		"backend": "local", "basePath": mnt, "capacityEnforcement": "required"})
	suite.CreateClaim(t, ns, "data", class.Name, framework.OnNode(node), framework.Request("16Mi"))

	// The crash: the process died at the point, by SIGKILL, and left exactly what that point
	// leaves: one directory under a temporary name, a subvolume, limited only past
	// SetLimit, and no PV.
	waitKilledAt(t, proc, point)
	temps := tempDirs(t, mnt)
	if len(temps) != 1 || len(entries(t, mnt)) != 1 {
		t.Fatalf("base after the crash holds %v, want one temporary directory and nothing else", entries(t, mnt))
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(mnt, temps[0]), &st); err != nil || st.Ino != 256 {
		t.Fatalf("temporary directory %s: inode %d, %v; want a btrfs subvolume (inode 256)", temps[0], st.Ino, err)
	}
	crashed := quotatest.Qgroups(t, mnt)
	wantLimit := "none"
	if point == failpoint.BeforeRename {
		wantLimit = fmt.Sprint(size)
	}
	if len(crashed) != len(before)+1 || !hasLimit(crashed, wantLimit) {
		t.Fatalf("qgroups after the crash %v (before the claim %v): want one more, limited to %s", crashed, before, wantLimit)
	}
	if pvs := pvsOf(t, ns); len(pvs) != 0 {
		t.Fatalf("PVs after the crash: %v, want none", pvs)
	}

	proc.Env = nil
	must(t, proc.Restart())
	_, pv := waitBound(t, ns, "data")
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	must(t, err)
	if !strings.HasPrefix(attrs.Quota, "btrfs/") {
		t.Errorf("PV quota attribute %q, want the volume's btrfs qgroup", attrs.Quota)
	}
	if got := pv.Spec.Capacity[v1.ResourceStorage]; got.Value() != size {
		t.Errorf("PV capacity %s, want %d", got.String(), size)
	}
	if left := tempDirs(t, mnt); len(left) != 0 {
		t.Errorf("temporary directories left after the retry: %v", left)
	}
	written, err := quotatest.Fill(t, filepath.Join(mnt, attrs.Path, "fill"), 2*size)
	if !errors.Is(err, unix.EDQUOT) || written > size || written < size/2 {
		t.Errorf("writing %d bytes into the %d-byte volume: %d went in, then %v; want EDQUOT at the limit", 2*size, size, written, err)
	}
	// One qgroup more than before the claim, the volume's, with the claim's size: the one the
	// crashed attempt made is gone.
	sub := "0/" + strings.TrimPrefix(attrs.Quota, "btrfs/")
	// The crashed attempt's subvolume is gone; its qgroup goes with a later commit.
	err = framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		got := quotatest.Qgroups(t, mnt)
		return len(got) == len(before)+1 && got[sub] == fmt.Sprint(size),
			fmt.Errorf("qgroups %v (before the claim %v): want only %s more, limited to %d", got, before, sub, size)
	})
	if err != nil {
		t.Errorf("after the retry: %v", err)
	}

	deleteClaim(t, ns, "data")
	waitPVGone(t, pv.Name)
	// The kernel drops a deleted subvolume's qgroup itself, in a transaction after the cleaner
	// has dropped the subvolume (dirpv's own destroy gets EBUSY until then): wait for it.
	var got map[string]string
	err = framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		got = quotatest.Qgroups(t, mnt)
		return len(got) == len(before), fmt.Errorf("qgroups %v, want those before the claim %v", got, before)
	})
	if err != nil {
		t.Errorf("after the claim was deleted: %v", err)
	}
	if got := entries(t, mnt); len(got) != 0 {
		t.Errorf("base after the claim was deleted holds %v, want nothing", got)
	}
}

// tempDirs lists the names in dir that dirpv makes volumes under before they are complete.
func tempDirs(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, name := range entries(t, dir) {
		if strings.HasPrefix(name, volume.ReservedPrefix+"new-") {
			out = append(out, name)
		}
	}
	return out
}

func hasLimit(groups map[string]string, limit string) bool {
	for id, l := range groups {
		if id != "0/5" && l == limit {
			return true
		}
	}
	return false
}

// pvsOf lists the names of the PVs bound to claims of ns.
func pvsOf(t *testing.T, ns string) []string {
	t.Helper()
	pvs, err := suite.Client.CoreV1().PersistentVolumes().List(context.Background(), metav1.ListOptions{})
	must(t, err)
	var out []string
	for _, pv := range pvs.Items {
		if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns {
			out = append(out, pv.Name)
		}
	}
	return out
}
