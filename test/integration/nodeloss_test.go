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
	must(t, suite.Cluster.CreateReadyNode(ctx, nodeB, map[string]string{"kubernetes.io/hostname": "host-" + nodeB}))
	work := t.TempDir()
	proc, err := suite.StartDirpv(ctx, "node-b", "node",
		"--v=2", "--node-name", nodeB, "--allowed-base-paths", suite.Work.BaseRoot,
		"--csi-endpoint", "unix://"+filepath.Join(work, "csi.sock"), "--plugin-registration-dir", "-")
	must(t, err)
	t.Cleanup(func() { proc.Stop(10 * time.Second) })
	must(t, suite.Cluster.RegisterCSIDriver(ctx, nodeB, "dirpv.io"))

	ns := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	suite.CreateClaim(t, ns, "lost", class.Name, framework.OnNode(nodeB))
	_, pv := waitBound(t, ns, "lost")

	proc.Kill()
	must(t, suite.Client.CoreV1().Nodes().Delete(ctx, nodeB, metav1.DeleteOptions{}))
	deleteClaim(t, ns, "lost")
	waitPVGone(t, pv.Name)
	if _, err := framework.WaitForEvent(ctx, suite.Client, "", "PersistentVolume", pv.Name, "VolumeDataOnLostNode", nodeB, timeout); err != nil {
		t.Error(err)
	}
	if got := entries(t, base); len(got) != 1 {
		t.Errorf("base = %v: nobody may remove a lost node's directory", got)
	}

	// Other claims keep flowing.
	suite.CreateClaim(t, ns, "after", class.Name, framework.OnNode(nodeA))
	waitBound(t, ns, "after")
}
