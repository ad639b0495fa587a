package integration

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// A class with reclaimPolicy Retain: Kubernetes keeps the PV Released and never asks dirpv to
// delete, so the directory stays whatever onDelete says, also once an admin deletes the PV.
// What each onDelete policy does under reclaimPolicy Delete, TestDeletionOrderRunsOnDelete and
// TestHostileDeleteStaysAtTheLeaf check on disk, and test/e2e/install's TestExamplesRunAsWritten
// with pods (the retain, archive and path-pattern examples).
func TestReclaimRetainKeepsTheDirectory(t *testing.T) {
	ns := suite.NewNamespace(t)
	class, base := localClass(t, map[string]string{"onDelete": "delete"}, framework.ReclaimRetain)
	suite.CreateClaim(t, ns, "c", class.Name, framework.OnNode(nodeA))
	_, pv := waitBound(t, ns, "c")
	rel := pv.Spec.CSI.VolumeAttributes["path"]
	deleteClaim(t, ns, "c")
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		return err == nil && pv.Status.Phase == v1.VolumeReleased, err
	})
	must(t, err)
	must(t, suite.Client.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{}))
	waitPVGone(t, pv.Name)
	if got := entries(t, base); !slices.Equal(got, []string{rel}) {
		t.Errorf("base after the Released PV's deletion: %v, want the directory kept", got)
	}
}

// A refusal shows on the claim as an event, and nothing appears on disk: one of a class's
// parameters (through the node instance's Provision), one the lib makes itself (Block), one of
// the claim's, and one of the controller's (an Immediate local class). Each of dirpv's own
// refusals (templates, escapes, onDelete, ...) and its message, provisioner's
// TestRejectionsLeaveNothingOnDisk checks on disk.
func TestRejectionsAreEventsAndTouchNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		params map[string]string
		class  []framework.ClassOption
		claim  []framework.ClaimOption
		want   string
	}{
		{name: "unknown-parameter", params: map[string]string{"basepath": "/tmp"}, want: "unknown StorageClass parameters"},
		{name: "block-mode", claim: []framework.ClaimOption{func(c *v1.PersistentVolumeClaim) {
			b := v1.PersistentVolumeBlock
			c.Spec.VolumeMode = &b
		}}, want: "block volume"},
		{name: "rwx-on-local", claim: []framework.ClaimOption{framework.AccessModes(v1.ReadWriteMany)}, want: "ReadWriteMany"},
		{name: "immediate-local", class: []framework.ClassOption{framework.Immediate}, want: "WaitForFirstConsumer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := suite.NewNamespace(t)
			class, base := localClass(t, tc.params, tc.class...)
			opts := append([]framework.ClaimOption{}, tc.claim...)
			if class.VolumeBindingMode != nil {
				opts = append([]framework.ClaimOption{framework.OnNode(nodeA)}, opts...)
			} else {
				opts = append([]framework.ClaimOption{func(c *v1.PersistentVolumeClaim) { c.Annotations = map[string]string{} }}, opts...)
			}
			suite.CreateClaim(t, ns, "c", class.Name, opts...)
			waitEvent(t, ns, "PersistentVolumeClaim", "c", "ProvisioningFailed", tc.want)
			if got := entries(t, base); len(got) != 0 {
				t.Errorf("refused claim left %v in the base", got)
			}
		})
	}
}

func TestNFSClassWithoutServerIsRefused(t *testing.T) {
	ns := suite.NewNamespace(t)
	class := suite.CreateClass(t, "nfs-no-server", map[string]string{"backend": "nfs", "share": "/export"}, framework.Immediate)
	suite.CreateClaim(t, ns, "c", class.Name, framework.AccessModes(v1.ReadWriteMany))
	waitEvent(t, ns, "PersistentVolumeClaim", "c", "ProvisioningFailed", "server and share")
}

// A claim can reach a node instance before the class it names (the claim's watch and the
// class's are separate): here it is already placed, labelled for node-a (as the API server's
// admission policy labels it in the write that places it) and handed to dirpv, so neither
// kube-controller-manager nor dirpv controller writes it again once the class exists. node-a
// must still provision it; it used to drop the claim until the next resync, 15 minutes on,
// which left the VM tier's quota claim Pending when the guest's class watch lagged.
func TestClaimSeenBeforeItsClassBinds(t *testing.T) {
	ns := suite.NewNamespace(t)
	name := uniqueName("late-class")
	suite.CreateClaim(t, ns, "early", name, labelled(nodeA), framework.OnNode(nodeA),
		framework.Annotation("volume.kubernetes.io/storage-provisioner", "dirpv.io"),
		framework.Annotation("volume.beta.kubernetes.io/storage-provisioner", "dirpv.io"))
	// A claim node-a binds after "early" was created: node-a's claim watch has delivered
	// "early" (one watch, in order) while its class did not exist yet.
	witness, _ := localClass(t, nil)
	suite.CreateClaim(t, ns, "witness", witness.Name, framework.OnNode(nodeA))
	waitBound(t, ns, "witness")

	base := filepath.Join(suite.Work.BaseRoot, name)
	suite.CreateClass(t, name, map[string]string{"backend": "local", "basePath": base})
	_, pv := waitBound(t, ns, "early")
	if _, err := os.Stat(filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"])); err != nil {
		t.Errorf("the early claim's volume: %v", err)
	}
}
