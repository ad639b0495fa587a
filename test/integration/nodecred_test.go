package integration

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// TestNodeCredentialsWriteOnlyTheirNode: with deploy/'s RBAC and node-write policy applied as
// shipped, a token the API server binds to a dirpv node pod on node-a (what kubelet projects
// into the pod) writes node-a's PersistentVolumes and claims placed on node-a, as dirpv node
// does, and is refused with the policy's message for node-c's: creating, changing or deleting
// a PV of node-c or one whose node affinity reaches beyond node-a, touching a claim placed on
// node-c, moving a claim of node-a to node-c or binding it. A token of the same service
// account that is bound to no pod names no node and writes nothing.
func TestNodeCredentialsWriteOnlyTheirNode(t *testing.T) {
	ctx := context.Background()
	for _, path := range []string{"deploy/base/rbac-node.yaml", framework.NodeWritePolicy} {
		inst, err := framework.ApplyFile(ctx, suite.Cluster.Kubeconfig, path)
		must(t, err)
		t.Cleanup(func() {
			if err := inst.Uninstall(context.Background()); err != nil {
				t.Error(err)
			}
		})
	}
	asA := nodeCredentials(t, nodeA)
	must(t, framework.WaitNodeWritePolicy(ctx, asA, nodeA, timeout))
	pvs := asA.CoreV1().PersistentVolumes()

	// A PV the node's credentials (or others) create where they should not is taken away too.
	createPV := func(c kubernetes.Interface, pv *v1.PersistentVolume) (*v1.PersistentVolume, error) {
		made, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
		if err == nil {
			t.Cleanup(func() {
				suite.Client.CoreV1().PersistentVolumes().Delete(context.Background(), made.Name, metav1.DeleteOptions{})
			})
		}
		return made, err
	}
	const pvRefused = "write only PersistentVolumes of that node"
	mergePatch := func(obj map[string]any) []byte {
		b, err := json.Marshal(obj)
		must(t, err)
		return b
	}

	// Another node's PV: not created, changed (repointed to another claim), nor deleted.
	_, err := createPV(asA, framework.LocalPV(uniqueName("pv-c"), nodeC))
	wantRefused(t, "create a PV of node-c", err, pvRefused)
	// Made by the test's own (admin) credentials, as another node would.
	otherPV, err := createPV(suite.Client, framework.LocalPV(uniqueName("pv-c"), nodeC))
	must(t, err)
	repoint := mergePatch(map[string]any{"spec": map[string]any{"claimRef": map[string]any{"namespace": "elsewhere", "name": "theirs"}}})
	_, err = pvs.Patch(ctx, otherPV.Name, types.MergePatchType, repoint, metav1.PatchOptions{})
	wantRefused(t, "repoint a PV of node-c", err, pvRefused)
	wantRefused(t, "delete a PV of node-c", pvs.Delete(ctx, otherPV.Name, metav1.DeleteOptions{}), pvRefused)

	// A PV that says node-a but may be mounted elsewhere.
	for name, change := range map[string]func(*v1.PersistentVolume){
		"no node affinity": func(pv *v1.PersistentVolume) { pv.Spec.NodeAffinity = nil },
		"node affinity on node-c too": func(pv *v1.PersistentVolume) {
			e := &pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0]
			e.Values = append(e.Values, nodeC)
		},
		"a second node affinity term": func(pv *v1.PersistentVolume) {
			terms := &pv.Spec.NodeAffinity.Required.NodeSelectorTerms
			*terms = append(*terms, v1.NodeSelectorTerm{MatchExpressions: []v1.NodeSelectorRequirement{{
				Key: v1.LabelHostname, Operator: v1.NodeSelectorOpIn, Values: []string{nodeC}}}})
		},
		"node affinity by another label": func(pv *v1.PersistentVolume) {
			pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Key = "example.com/host"
		},
		"routed to node-c": func(pv *v1.PersistentVolume) { pv.Labels[provisioner.LabelNode] = nodeC },
	} {
		pv := framework.LocalPV(uniqueName("pv-a-bad"), nodeA)
		change(pv)
		_, err := createPV(asA, pv)
		wantRefused(t, "create a PV of node-a with "+name, err, pvRefused)
	}

	// Its own node's PV: created, its finalizer patched in and out, deleted; but not handed
	// to another node.
	ownPV, err := createPV(asA, framework.LocalPV(uniqueName("pv-a"), nodeA))
	if err != nil {
		t.Fatalf("create a PV of node-a with node-a's credentials: %v", err)
	}
	// A finalizer of the test's own: node-a's provisioning lib, running in this suite, takes
	// its own off a Retain PV.
	finalizer := mergePatch(map[string]any{"metadata": map[string]any{"finalizers": []string{"example.com/test"}}})
	if _, err := pvs.Patch(ctx, ownPV.Name, types.MergePatchType, finalizer, metav1.PatchOptions{}); err != nil {
		t.Errorf("patch a finalizer onto a PV of node-a: %v", err)
	}
	handOver := mergePatch(map[string]any{"metadata": map[string]any{"annotations": map[string]string{provisioner.AnnNode: nodeC}}})
	_, err = pvs.Patch(ctx, ownPV.Name, types.MergePatchType, handOver, metav1.PatchOptions{})
	wantRefused(t, "hand a PV of node-a over to node-c", err, pvRefused)
	if err := pvs.Delete(ctx, ownPV.Name, metav1.DeleteOptions{}); err != nil {
		t.Errorf("delete a PV of node-a: %v", err)
	}
	noFinalizer := mergePatch(map[string]any{"metadata": map[string]any{"finalizers": nil}})
	if _, err := pvs.Patch(ctx, ownPV.Name, types.MergePatchType, noFinalizer, metav1.PatchOptions{}); err != nil {
		t.Errorf("remove the finalizer of a deleted PV of node-a: %v", err)
	}

	// Claims, of a class nobody serves, so that nothing but the test writes them. dirpv node
	// updates claims (get, change, update), and patches their status.
	ns := suite.NewNamespace(t)
	const claimRefused = "write only claims placed on that node"
	update := func(c kubernetes.Interface, name string, change func(*v1.PersistentVolumeClaim)) error {
		claim, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		change(claim)
		_, err = c.CoreV1().PersistentVolumeClaims(ns).Update(ctx, claim, metav1.UpdateOptions{})
		return err
	}
	note := func(c *v1.PersistentVolumeClaim) {
		metav1.SetMetaDataAnnotation(&c.ObjectMeta, provisioner.AnnCopiedFrom, "test")
	}
	status := mergePatch(map[string]any{"status": map[string]any{"conditions": []map[string]string{{"type": "Resizing", "status": "True"}}}})
	patchStatus := func(name string) error {
		_, err := asA.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, name, types.MergePatchType, status, metav1.PatchOptions{}, "status")
		return err
	}

	onC := suite.CreateClaim(t, ns, "on-c", "served-by-nobody", framework.OnNode(nodeC))
	wantRefused(t, "update a claim placed on node-c", update(asA, onC.Name, note), claimRefused)
	wantRefused(t, "patch the status of a claim placed on node-c", patchStatus(onC.Name), claimRefused)
	labelledC := suite.CreateClaim(t, ns, "labelled-c", "served-by-nobody", labelled(nodeC))
	wantRefused(t, "update a claim labelled with node-c", update(asA, labelledC.Name, note), claimRefused)

	onA := suite.CreateClaim(t, ns, "on-a", "served-by-nobody", framework.OnNode(nodeA))
	if err := update(asA, onA.Name, note); err != nil {
		t.Errorf("update a claim placed on node-a: %v", err)
	}
	if err := patchStatus(onA.Name); err != nil {
		t.Errorf("patch the status of a claim placed on node-a: %v", err)
	}
	move := func(c *v1.PersistentVolumeClaim) { c.Annotations["volume.kubernetes.io/selected-node"] = nodeC }
	wantRefused(t, "move a claim placed on node-a to node-c", update(asA, onA.Name, move), claimRefused)
	bind := func(c *v1.PersistentVolumeClaim) { c.Spec.VolumeName = otherPV.Name }
	wantRefused(t, "bind a claim placed on node-a", update(asA, onA.Name, bind), claimRefused)
	relabel := func(c *v1.PersistentVolumeClaim) { c.Labels = map[string]string{provisioner.LabelNode: nodeC} }
	wantRefused(t, "label a claim placed on node-a with node-c", update(asA, onA.Name, relabel), claimRefused)
	// The lib hands a claim it cannot provision back to the scheduler.
	unplace := func(c *v1.PersistentVolumeClaim) { delete(c.Annotations, "volume.kubernetes.io/selected-node") }
	if err := update(asA, onA.Name, unplace); err != nil {
		t.Errorf("hand a claim placed on node-a back to the scheduler: %v", err)
	}
	labelledA := suite.CreateClaim(t, ns, "labelled-a", "served-by-nobody", labelled(nodeA))
	if err := update(asA, labelledA.Name, note); err != nil {
		t.Errorf("update an unplaced claim labelled with node-a: %v", err)
	}

	// The service account's token bound to no pod names no node.
	unbound := credentials(t, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](600)}})
	_, err = createPV(unbound, framework.LocalPV(uniqueName("pv-nobody"), nodeA))
	wantRefused(t, "create a PV with a token bound to no pod", err, "only with a token bound to a pod on a node")
	wantRefused(t, "update a claim with a token bound to no pod", update(unbound, labelledA.Name, note), "only with a token bound to a pod on a node")
}

// nodeCredentials returns a client with the credentials kubelet would give a dirpv node pod on
// node: a token of the dirpv-node service account bound to such a pod, which the test creates
// (the node has no kubelet to run it).
func nodeCredentials(t *testing.T, node string) kubernetes.Interface {
	t.Helper()
	pods := suite.Client.CoreV1().Pods("dirpv")
	pod, err := pods.Create(context.Background(), &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "dirpv-node-"},
		Spec: v1.PodSpec{
			NodeName:           node,
			ServiceAccountName: "dirpv-node",
			Containers:         []v1.Container{{Name: "dirpv", Image: "ghcr.io/dirpv/dirpv"}},
		},
	}, metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		pods.Delete(context.Background(), pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
	})
	return credentials(t, &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: ptr.To[int64](600),
		BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}})
}

// credentials returns a client authenticated with the dirpv-node service account's token
// issued for req.
func credentials(t *testing.T, req *authenticationv1.TokenRequest) kubernetes.Interface {
	t.Helper()
	tok, err := suite.Client.CoreV1().ServiceAccounts("dirpv").CreateToken(context.Background(), "dirpv-node", req, metav1.CreateOptions{})
	must(t, err)
	cfg, err := clientcmd.BuildConfigFromFlags("", suite.Cluster.Kubeconfig)
	must(t, err)
	cfg = rest.AnonymousClientConfig(cfg)
	cfg.BearerToken = tok.Status.Token
	c, err := kubernetes.NewForConfig(cfg)
	must(t, err)
	return c
}

// wantRefused fails unless err is the API server's Forbidden carrying msg.
func wantRefused(t *testing.T, what string, err error, msg string) {
	t.Helper()
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), msg) {
		t.Errorf("%s: got %v, want Forbidden: ... %s", what, err, msg)
	}
}

// uniqueName is prefix made unique, for cluster-scoped objects that a repeated test must not
// find left from its last run while they are being deleted.
func uniqueName(prefix string) string { return prefix + "-" + rand.String(6) }

// labelled labels a claim with node's dirpv.io/node label, as dirpv controller labels a claim
// bound to a PV of the node.
func labelled(node string) framework.ClaimOption {
	return withLabel(provisioner.LabelNode, provisioner.NodeLabel(node))
}
