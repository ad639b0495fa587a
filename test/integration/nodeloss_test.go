package integration

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// A node with local volumes is lost (its dirpv instance dies with it and the Node object is
// deleted). Deleting the claim still completes: the controller removes the PV and says on
// it that the data stayed on the lost node; the queue is not jammed for other claims.
func TestLostNodeDoesNotJamDeletion(t *testing.T) {
	const nodeB = "node-b"
	ctx := context.Background()
	if err := testCluster.CreateReadyNode(ctx, nodeB, map[string]string{"kubernetes.io/hostname": "host-" + nodeB}); err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	proc, err := framework.StartDirpv(ctx, dirpvBin, "node-b", logDir, "node", "--kubeconfig", testCluster.Kubeconfig,
		"--v=2", "--node-name", nodeB, "--allowed-base-paths", baseRoot,
		"--csi-endpoint", "unix://"+filepath.Join(work, "csi.sock"), "--plugin-registration-dir", "-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proc.Stop(10 * time.Second) })
	if err := testCluster.RegisterCSIDriver(ctx, nodeB, "dirpv.io"); err != nil {
		t.Fatal(err)
	}

	ns := newNamespace(t)
	class, base := localClass(t, nil)
	createClaim(t, ns, "lost", class.Name, onNode(nodeB))
	_, pv := waitBound(t, ns, "lost")

	proc.Kill()
	if err := client.CoreV1().Nodes().Delete(ctx, nodeB, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deleteClaim(t, ns, "lost")
	waitPVGone(t, pv.Name)
	if _, err := framework.WaitForEvent(ctx, client, "", "PersistentVolume", pv.Name, "VolumeDataOnLostNode", nodeB, timeout); err != nil {
		t.Error(err)
	}
	if got := entries(t, base); len(got) != 1 {
		t.Errorf("base = %v: nobody may remove a lost node's directory", got)
	}

	// Other claims keep flowing.
	createClaim(t, ns, "after", class.Name, onNode(nodeA))
	waitBound(t, ns, "after")
}
