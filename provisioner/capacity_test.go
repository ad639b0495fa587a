package provisioner

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

func sizedClaim(name, size string) *v1.PersistentVolumeClaim {
	c := claim(name)
	c.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse(size)
	return c
}

// TestProvisionLocalEnforcesSize: on a btrfs base with quota, the claim's size is the volume's
// limit from the moment its PV exists, by default (bestEffort): writes past it fail with EDQUOT,
// a neighbour is unaffected, the PV names the quota, and Delete removes the volume and frees
// the quota. With capacityEnforcement required, test/integration's TestLocalClaimExpandsOnline
// shows the same limit through a real apiserver.
func TestProvisionLocalEnforcesSize(t *testing.T) {
	f := newFixtureOn(t, quotatest.Btrfs(t, true))
	class := f.localClass(nil)
	pv, state, err := f.node.Provision(context.Background(), opts(class, sizedClaim("a", "10Mi")))
	if err != nil || state != controller.ProvisioningFinished {
		t.Fatalf("Provision = %v, %v", state, err)
	}
	neighbour, _, err := f.node.Provision(context.Background(), opts(class, sizedClaim("b", "10Mi")))
	must(t, err)
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	must(t, err)
	id, err := quota.ParseID(attrs.Quota)
	if err != nil || id.Kind != quota.Btrfs {
		t.Fatalf("PV attribute %s = %q (%v), want a btrfs quota", volume.AttrQuota, attrs.Quota, err)
	}
	if n, err := quotatest.Fill(t, filepath.Join(f.base, attrs.Path, "big"), 20<<20); !errors.Is(err, unix.EDQUOT) || n > 10<<20 {
		t.Errorf("writing 20 MiB into a 10Mi claim: %d MiB went in, err %v; want EDQUOT by 10 MiB", n>>20, err)
	}
	nrel := neighbour.Spec.CSI.VolumeAttributes[volume.AttrPath]
	if n, err := quotatest.Fill(t, filepath.Join(f.base, nrel, "file"), 8<<20); err != nil {
		t.Errorf("neighbour: %d of 8 MiB went in: %v", n>>20, err)
	}
	// Retried Provision (its PV was never saved) adopts the volume and its quota.
	again, _, err := f.node.Provision(context.Background(), opts(class, sizedClaim("a", "10Mi")))
	if err != nil || again.Spec.CSI.VolumeAttributes[volume.AttrQuota] != attrs.Quota {
		t.Errorf("retried Provision: quota %q, %v; want %q", again.Spec.CSI.VolumeAttributes[volume.AttrQuota], err, attrs.Quota)
	}
	must(t, f.node.Delete(context.Background(), pv))
	if _, err := os.Lstat(filepath.Join(f.base, attrs.Path)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume still there after Delete: %v", err)
	}
	if err := f.node.Delete(context.Background(), pv); err != nil {
		t.Errorf("repeated Delete: %v", err)
	}
	select {
	case e := <-f.events.Events:
		t.Errorf("unexpected event %q", e)
	default:
	}
}

// TestQuotaEnabledUnderRunningNodeIsUsed: a class that requires enforcement on a base that
// cannot enforce gets its claim refused, with a message that says how to fix it, and nothing
// on disk; once the admin enables quota there, the running node instance publishes its room
// for the class and provisions its claims with a limit, without a restart.
func TestQuotaEnabledUnderRunningNodeIsUsed(t *testing.T) {
	f := newFixtureOn(t, quotatest.Btrfs(t, false))
	class := f.localClass(map[string]string{ParamCapacityEnforcement: string(EnforceRequired)})
	capacity := func() int64 {
		t.Helper()
		resp, err := f.node.GetCapacity(context.Background(), &csi.GetCapacityRequest{Parameters: class.Parameters})
		if err != nil {
			t.Fatalf("GetCapacity: %v", err)
		}
		return resp.AvailableCapacity
	}
	if got := capacity(); got != 0 {
		t.Errorf("capacity for a required class before quota is enabled = %d, want 0", got)
	}
	_, state, err := f.node.Provision(context.Background(), opts(class, sizedClaim("before", "10Mi")))
	if err == nil || state != controller.ProvisioningReschedule {
		t.Fatalf("Provision = %v, %v; want a refusal that lets another node try", state, err)
	}
	for _, want := range []string{"capacityEnforcement: required", f.base, "btrfs quota enable"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not say %q", err, want)
		}
	}
	if tree := listTree(t, f.base); len(tree) != 0 {
		t.Errorf("refused claim left %v", tree)
	}
	if out, err := exec.Command("btrfs", "quota", "enable", f.base).CombinedOutput(); err != nil {
		t.Fatalf("btrfs quota enable: %v: %s", err, out)
	}
	if got := capacity(); got == 0 {
		t.Error("capacity for a required class after quota was enabled is still 0")
	}
	pv, _, err := f.node.Provision(context.Background(), opts(class, sizedClaim("after", "10Mi")))
	if err != nil {
		t.Fatalf("Provision after quota was enabled: %v", err)
	}
	if q := pv.Spec.CSI.VolumeAttributes[volume.AttrQuota]; !strings.HasPrefix(q, "btrfs/") {
		t.Errorf("PV quota = %q, want a btrfs qgroup", q)
	}
	rel := pv.Spec.CSI.VolumeAttributes[volume.AttrPath]
	if n, err := quotatest.Fill(t, filepath.Join(f.base, rel, "data"), 20<<20); !errors.Is(err, unix.EDQUOT) {
		t.Errorf("10Mi volume took %d bytes of 20 MiB: %v; want EDQUOT", n, err)
	}
}
