package provisioner

import (
	"context"
	"slices"
	"testing"

	"github.com/kubernetes-csi/external-resizer/pkg/util"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// TestResizeLocalRaisesTheLimitOnItsNodeOnly: only the node instance holding a local volume
// resizes it, and not once the PV is Released, lives elsewhere or outside the allowed bases; a
// volume no longer the claim's is refused; NFS volumes are resized, recorded only, by the
// controller, which mounts nothing for it. That the new limit holds at once for a process
// that hit the old one, that growth beyond the base's free space is infeasible for good, and
// that an NFS claim's new size is recorded, test/integration's TestLocalClaimExpandsOnline and
// TestNFSClaimResizeIsRecorded show through the external-resizer.
func TestResizeLocalRaisesTheLimitOnItsNodeOnly(t *testing.T) {
	f := newFixtureOn(t, quotatest.Btrfs(t, true))
	pvc, pv := f.boundLocalVolume()
	node, ctrl := f.node.Resizer(context.Background()), f.ctrl.Resizer(context.Background())
	if !node.CanSupport(pv, pvc) || ctrl.CanSupport(pv, pvc) {
		t.Errorf("CanSupport of a local PV: node %v, controller %v; want only the node", node.CanSupport(pv, pvc), ctrl.CanSupport(pv, pvc))
	}
	for what, change := range map[string]func(*v1.PersistentVolume){
		"a Released PV (a resize could race its deletion)": func(pv *v1.PersistentVolume) { pv.Status.Phase = v1.VolumeReleased },
		"another node's PV":              func(pv *v1.PersistentVolume) { pv.Annotations[AnnNode] = "node-b" },
		"a PV outside the allowed bases": func(pv *v1.PersistentVolume) { pv.Spec.CSI.VolumeAttributes[volume.AttrBasePath] = "/etc" },
	} {
		other := pv.DeepCopy()
		change(other)
		if node.CanSupport(other, pvc) {
			t.Errorf("CanSupport of %s is true", what)
		}
	}

	stale := pv.DeepCopy()
	stale.Spec.ClaimRef.UID = "uid-other"
	if _, _, err := node.Resize(stale, resource.MustParse("64Mi")); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Resize for a claim the volume is not of = %v, want FailedPrecondition", err)
	}

	nfs := pv.DeepCopy()
	nfs.Spec.CSI.VolumeAttributes = volume.Attributes{Backend: volume.BackendNFS, Server: "nfs.example", Share: "/export", Path: "v"}.Map()
	if node.CanSupport(nfs, pvc) || !ctrl.CanSupport(nfs, pvc) {
		t.Errorf("CanSupport of an NFS PV: node %v, controller %v; want only the controller", node.CanSupport(nfs, pvc), ctrl.CanSupport(nfs, pvc))
	}
	if size, _, err := ctrl.Resize(nfs, resource.MustParse("2Gi")); err != nil || size.Cmp(resource.MustParse("2Gi")) != 0 {
		t.Errorf("Resize of an NFS volume = %s, %v; want 2Gi recorded", size.String(), err)
	}
	if log := f.mounter.GetLog(); len(log) != 0 {
		t.Errorf("recording an NFS volume's size mounted something: %v", log)
	}
}

// TestResizeUnlimitedIsRecorded: by default (bestEffort) a base that cannot enforce sizes
// still provisions, without a quota in the PV, and the claim gets an event saying its size is
// not enforced; such a volume has no limit to raise: its resize is recorded, whatever the
// size, and changes nothing on disk.
func TestResizeUnlimitedIsRecorded(t *testing.T) {
	f := newFixture(t)
	_, pv := f.boundLocalVolume()
	if q, ok := pv.Spec.CSI.VolumeAttributes[volume.AttrQuota]; ok {
		t.Fatalf("PV names quota %q on a base without quota", q)
	}
	waitEvent(t, f.events, "Normal SizeNotEnforced ", "8Mi", "prjquota")
	before := listTree(t, f.base)
	size, _, err := f.node.Resizer(context.Background()).Resize(pv, resource.MustParse("1Pi"))
	if err != nil || size.Cmp(resource.MustParse("1Pi")) != 0 {
		t.Errorf("Resize of an unlimited volume = %s, %v; want 1Pi recorded", size.String(), err)
	}
	if after := listTree(t, f.base); !slices.Equal(before, after) {
		t.Errorf("recorded-only resize changed the base: %v, then %v", before, after)
	}

	// Once drained, at shutdown, the Resizer takes no more resizes (the bases they need are
	// about to close), and says so with a code the resize controller retries, for the next
	// instance to do.
	r := f.node.Resizer(context.Background())
	r.Drain()
	if _, _, err := r.Resize(pv, resource.MustParse("16Mi")); status.Code(err) != codes.Unavailable || util.IsFinalError(err) {
		t.Errorf("Resize after Drain = %v; want a non-final Unavailable", err)
	}
}

// boundLocalVolume provisions an 8Mi local volume on the fixture's node and returns its claim
// and its PV as the resize controller sees them once bound.
func (f *fixture) boundLocalVolume() (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
	f.t.Helper()
	pvc := sizedClaim("a", "8Mi")
	pv, _, err := f.node.Provision(context.Background(), opts(f.localClass(nil), pvc))
	must(f.t, err)
	pv.Spec.ClaimRef = &v1.ObjectReference{Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID}
	pv.Status.Phase = v1.VolumeBound
	return pvc, pv
}
