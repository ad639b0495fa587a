package integration

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// cached is what the process reports holding in its informer cache of resource.
func cached(ctx context.Context, p *framework.Process, resource string) (float64, error) {
	m, err := framework.Scrape(ctx, p)
	if err != nil {
		return 0, err
	}
	series := fmt.Sprintf(`dirpv_informer_cached_objects{resource=%q}`, resource)
	v, ok := m[series]
	if !ok {
		return 0, fmt.Errorf("%s reports no %s", p.Name, series)
	}
	return v, nil
}

// waitLabel waits until the claim carries node as its node label.
func waitLabel(t *testing.T, ns, name, node string) {
	t.Helper()
	var got map[string]string
	if err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		got = c.Labels
		return c.Labels[provisioner.LabelNode] == node, nil
	}); err != nil {
		t.Fatalf("claim %s/%s labels %v, want %s=%s: %v\n--- controller log tail:\n%s", ns, name, got, provisioner.LabelNode, node, err, ctrlProc.Tail(3000))
	}
}

// Two nodes with a dirpv instance each: each instance caches its own claims and PVs (the
// objects labelled with its node) and no other, as it reports on /metrics, while both see
// every class.
func TestNodeInstancesCacheOwnVolumesOnly(t *testing.T) {
	const nodeB = "route-b"
	procB := startNodeInstance(t, nodeB, suite.Work.BaseRoot)
	ns := suite.NewNamespace(t)
	class, _ := localClass(t, nil)
	claims := map[string]string{"a1": nodeA, "a2": nodeA, "b1": nodeB, "b2": nodeB, "b3": nodeB}
	for name, node := range claims {
		suite.CreateClaim(t, ns, name, class.Name, framework.OnNode(node))
	}
	for name, node := range claims {
		_, pv := waitBound(t, ns, name)
		if pv.Labels[provisioner.LabelNode] != node {
			t.Errorf("PV of %s labels %v, want %s=%s", name, pv.Labels, provisioner.LabelNode, node)
		}
	}
	ctx := context.Background()
	allClaims, err := suite.Client.CoreV1().PersistentVolumeClaims("").List(ctx, metav1.ListOptions{})
	must(t, err)
	classes, err := suite.Client.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{})
	must(t, err)
	for _, n := range []struct {
		node string
		proc *framework.Process
		mine int
	}{{nodeA, nodeProc, 2}, {nodeB, procB, 3}} {
		own := metav1.ListOptions{LabelSelector: provisioner.NodeSelector(n.node)}
		if err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
			ownClaims, err := suite.Client.CoreV1().PersistentVolumeClaims("").List(ctx, own)
			if err != nil {
				return false, err
			}
			ownPVs, err := suite.Client.CoreV1().PersistentVolumes().List(ctx, own)
			if err != nil {
				return false, err
			}
			for _, c := range ownClaims.Items {
				if c.Annotations["volume.kubernetes.io/selected-node"] != n.node {
					return false, fmt.Errorf("claim %s/%s is labelled %s but placed on %q", c.Namespace, c.Name, n.node, c.Annotations["volume.kubernetes.io/selected-node"])
				}
			}
			for resource, want := range map[string]int{
				"persistentvolumeclaims": len(ownClaims.Items), "persistentvolumes": len(ownPVs.Items), "storageclasses": len(classes.Items),
			} {
				got, err := cached(ctx, n.proc, resource)
				if err != nil {
					return false, err
				}
				if int(got) != want {
					return false, fmt.Errorf("%s caches %v %s, want %d", n.proc.Name, got, resource, want)
				}
			}
			return len(ownClaims.Items) >= n.mine, fmt.Errorf("%s has %d claims, want %d", n.node, len(ownClaims.Items), n.mine)
		}); err != nil {
			t.Error(err)
		}
	}
	// The test means something only if each instance holds fewer claims than the cluster has.
	if own, _ := cached(ctx, procB, "persistentvolumeclaims"); int(own) >= len(allClaims.Items) {
		t.Errorf("%s caches %v claims of the cluster's %d", nodeB, own, len(allClaims.Items))
	}
}

// Claims and PVs made before node labels existed (an upgrade), or while no controller ran,
// are labelled once the controller runs, and then served: the new claim is provisioned and
// the old claim's volume deleted by its node.
func TestUnlabelledClaimsAndVolumesAreLabelledAtStart(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	suite.CreateClaim(t, ns, "old", class.Name, framework.OnNode(nodeA))
	_, pv := waitBound(t, ns, "old")

	if !ctrlProc.Stop(30 * time.Second) {
		t.Fatalf("controller did not stop on SIGTERM:\n%s", ctrlProc.Tail(3000))
	}
	t.Cleanup(func() {
		if exited, _ := ctrlProc.Exited(); exited {
			ctrlProc.Restart()
		}
	})
	unlabel := []byte(`{"metadata":{"labels":{"` + provisioner.LabelNode + `":null}}}`)
	_, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "old", types.MergePatchType, unlabel, metav1.PatchOptions{})
	must(t, err)
	_, err = suite.Client.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, unlabel, metav1.PatchOptions{})
	must(t, err)
	suite.CreateClaim(t, ns, "new", class.Name, framework.OnNode(nodeA))

	must(t, ctrlProc.Restart())
	must(t, ctrlProc.WaitHealthy(ctx, timeout))
	waitLabel(t, ns, "old", nodeA)
	waitLabel(t, ns, "new", nodeA)
	waitBound(t, ns, "new")
	if err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		got, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		return err == nil && got.Labels[provisioner.LabelNode] == nodeA, err
	}); err != nil {
		t.Fatalf("PV %s not labelled with its node: %v", pv.Name, err)
	}
	deleteClaim(t, ns, "old")
	waitPVGone(t, pv.Name)
	// The class's base is named after the test: with -count, earlier runs' volumes share it.
	var mine []string
	for _, e := range entries(t, base) {
		if strings.HasPrefix(e, ns+"-") {
			mine = append(mine, e)
		}
	}
	if len(mine) != 1 || !strings.HasPrefix(mine[0], ns+"-new-") {
		t.Errorf("volumes of namespace %s in the base = %v, want only the new claim's", ns, mine)
	}
}

// Claims and the pods that use them created back to back, as a StatefulSet does, and claims
// made already placed: dirpv's patches of the claims could race the scheduler's and
// kube-controller-manager's updates of them, which carry the resourceVersion they read. Every
// claim binds and no update fails: no event tells of a conflict, and none of a failed
// provisioning. (An earlier dirpv that annotated claims for itself before the scheduler placed
// them failed 11 of 15 pods' placement once here.)
func TestClaimsWithPodsBindWithoutConflicts(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, _ := localClass(t, nil)
	const n = 15
	for i := range n {
		name := fmt.Sprintf("data-%d", i)
		suite.CreateClaim(t, ns, name, class.Name)
		createPod(t, ns, fmt.Sprintf("app-%d", i), name, nodeA)
		suite.CreateClaim(t, ns, fmt.Sprintf("placed-%d", i), class.Name, framework.OnNode(nodeA))
	}
	must(t, framework.WaitForClaimsBound(ctx, suite.Client, ns, 2*n, 2*timeout))
	events, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	must(t, err)
	for _, e := range events.Items {
		// A scheduling attempt before the new class's capacity is published fails too, but
		// says so; a failed update says the object was modified.
		if e.Reason == "ProvisioningFailed" || strings.Contains(e.Message, "has been modified") {
			t.Errorf("%s %s/%s: %s: %s", e.Type, e.InvolvedObject.Kind, e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
}

// With deploy/'s MutatingAdmissionPolicy installed, the API server labels a claim of a local
// class in the write that places it: the claim made placed comes back from its create with the
// label, and so does the scheduler's update of an unplaced claim, so no write of dirpv's is
// needed; both bind. Claims of other classes get no label, and a node name too long for a
// label value is left to dirpv controller, which labels the claim with its hashed value.
func TestPlacedClaimLabelledByAdmissionPolicy(t *testing.T) {
	ctx := context.Background()
	policy, err := framework.ApplyFile(ctx, suite.Cluster.Kubeconfig, framework.NodeLabelPolicy)
	must(t, err)
	t.Cleanup(func() {
		if err := policy.Uninstall(context.Background()); err != nil {
			t.Error(err)
		}
	})
	ns := suite.NewNamespace(t)
	// The classes whose claims must not be labelled come first: the API server reads the
	// policy's params from its informer, in order, so once the local class (made last) takes
	// effect below, these are known too, and their "no label" below is the policy's answer.
	other := suite.CreateClass(t, "other-provisioner", map[string]string{"backend": "local"}, framework.Provisioner("example.com/other"))
	immediate := suite.CreateClass(t, "immediate-local", map[string]string{"backend": "local"}, framework.Immediate)
	class, _ := localClass(t, nil)
	must(t, framework.WaitNodeLabelPolicy(ctx, suite.Client, ns, class.Name, timeout))
	claims := suite.Client.CoreV1().PersistentVolumeClaims(ns)
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}

	placed := suite.CreateClaim(t, ns, "placed", class.Name, framework.OnNode(nodeA))
	if placed.Labels[provisioner.LabelNode] != nodeA {
		t.Errorf("claim created on %s came back with labels %v", nodeA, placed.Labels)
	}
	unplaced := suite.CreateClaim(t, ns, "unplaced", class.Name)
	if _, ok := unplaced.Labels[provisioner.LabelNode]; ok {
		t.Errorf("unplaced claim came back with labels %v", unplaced.Labels)
	}
	unplaced.Annotations = map[string]string{"volume.kubernetes.io/selected-node": nodeA}
	scheduled, err := claims.Update(ctx, unplaced, metav1.UpdateOptions{})
	must(t, err)
	if scheduled.Labels[provisioner.LabelNode] != nodeA {
		t.Errorf("claim placed on %s by an update came back with labels %v", nodeA, scheduled.Labels)
	}
	for _, name := range []string{"placed", "unplaced"} {
		if _, pv := waitBound(t, ns, name); pv.Labels[provisioner.LabelNode] != nodeA {
			t.Errorf("PV of %s labels %v, want %s=%s", name, pv.Labels, provisioner.LabelNode, nodeA)
		}
	}

	for _, c := range []string{other.Name, immediate.Name} {
		got, err := claims.Create(ctx, framework.NewClaim(ns, "of-"+c, c, framework.OnNode(nodeA)), dryRun)
		must(t, err)
		if _, ok := got.Labels[provisioner.LabelNode]; ok {
			t.Errorf("claim of class %s came back with labels %v", c, got.Labels)
		}
	}

	// Not a node name the scheduler writes, nor a valid label value: the claim is still
	// admitted, unlabelled, rather than failing validation after the policy's mutation.
	odd, err := claims.Create(ctx, framework.NewClaim(ns, "odd-node", class.Name, framework.OnNode("odd_node_")), dryRun)
	if err != nil {
		t.Fatalf("claim placed on a node name that is no label value: %v", err)
	}
	if _, ok := odd.Labels[provisioner.LabelNode]; ok {
		t.Errorf("claim placed on %q came back with labels %v", "odd_node_", odd.Labels)
	}

	long := "node-" + strings.Repeat("x", 70)
	c := suite.CreateClaim(t, ns, "long", class.Name, framework.OnNode(long))
	if _, ok := c.Labels[provisioner.LabelNode]; ok {
		t.Errorf("claim on a node of %d characters came back with labels %v", len(long), c.Labels)
	}
	waitLabel(t, ns, "long", provisioner.NodeLabel(long))
}
