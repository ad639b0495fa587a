package integration

import (
	"context"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// A node with local volumes is lost (its dirpv instance dies with it and the Node object is
// deleted). Deleting the claim still completes: the controller removes the PV and says on
// it that the data stayed on the lost node; the queue is not jammed for other claims.
func TestLostNodeDoesNotJamDeletion(t *testing.T) {
	const nodeB = "node-b"
	ctx := context.Background()
	proc := startNodeInstance(t, nodeB, suite.Work.BaseRoot)

	ns := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	suite.CreateClaim(t, ns, "lost", class.Name, framework.OnNode(nodeB))
	_, pv := waitBound(t, ns, "lost")

	proc.Kill()
	must(t, suite.Client.CoreV1().Nodes().Delete(ctx, nodeB, metav1.DeleteOptions{}))
	deleteClaim(t, ns, "lost")
	waitPVGone(t, pv.Name)
	waitEvent(t, "", "PersistentVolume", pv.Name, "VolumeDataOnLostNode", nodeB)
	if got := entries(t, base); len(got) != 1 {
		t.Errorf("base = %v: nobody may remove a lost node's directory", got)
	}

	// Other claims keep flowing.
	suite.CreateClaim(t, ns, "after", class.Name, framework.OnNode(nodeA))
	waitBound(t, ns, "after")
}
