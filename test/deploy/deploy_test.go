package deploy

import (
	"cmp"
	"fmt"
	"maps"
	"path"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/volume"
)

// helmOnlyLabels are the labels the chart adds for Helm's own bookkeeping; everything else must
// be the same as deploy/base's.
var helmOnlyLabels = []string{"helm.sh/chart", "app.kubernetes.io/managed-by"}

// TestHelmMatchesKustomize: for the kind installation and each option on top of it, `helm
// template` with the equivalent values renders exactly the kustomize objects (the option's
// component in an overlay as deploy/README.md says), field for field but for Helm's own
// labels, and the option adds to and changes in the kind installation exactly what it says. A
// change to one variant fails here until the other follows.
func TestHelmMatchesKustomize(t *testing.T) {
	kustomize, helm := tools(t)
	kind := kustomizeObjs(t, kustomize, "deploy/overlays/kind")
	for _, o := range []struct {
		name, overlay string
		apis, set     []string // helm's, besides HelmTemplate's API versions and kind-values.yaml
		adds          []string
		changes       map[string][]string
	}{
		{name: "kind", overlay: "deploy/overlays/kind"},
		// Only the network and the rollout change: a new replica wants the host port of the one
		// it replaces, so a surge pod would stay Pending on a cluster with no node free of a
		// controller, and the rollout with it (TestUpgradeFromRelease, one node).
		{name: "controller.hostNetwork", overlay: "test/deploy/testdata/controller-host-network", set: []string{"controller.hostNetwork=true"},
			changes: map[string][]string{"Deployment dirpv/dirpv-controller": {
				".spec.strategy: <nil> != map[rollingUpdate:map[maxSurge:0 maxUnavailable:1] type:RollingUpdate]",
				".spec.template.spec.dnsPolicy: <nil> != ClusterFirstWithHostNet", ".spec.template.spec.hostNetwork: <nil> != true"}}},
		// The chart cannot read files outside itself: deploy/helm/dirpv/files/monitoring must be a
		// copy of the component's dashboard and rules.
		{name: "monitoring", overlay: "test/deploy/testdata/monitoring", apis: []string{PrometheusRuleAPI}, set: []string{"monitoring.enabled=true"},
			adds: []string{"ConfigMap dirpv/dirpv-dashboard", "PrometheusRule dirpv/dirpv"}},
		{name: "snapshots", overlay: "test/deploy/testdata/snapshots", set: []string{"snapshots.enabled=true"}, adds: snapshotObjects},
	} {
		t.Run(o.name, func(t *testing.T) {
			objs := kustomizeObjs(t, kustomize, o.overlay)
			out, err := HelmTemplateFor(t.Context(), helm, "dirpv", append(o.apis, MutatingAdmissionPolicyAPI, ValidatingAdmissionPolicyAPI),
				[]string{"testdata/kind-values.yaml"}, o.set...)
			must(t, err)
			sameObjects(t, objs, decode(t, out))
			var added []string
			changes := map[string][]string{}
			for k := range objs {
				if kind[k] == nil {
					added = append(added, k)
				} else if d := diff("", kind[k].Object, objs[k].Object); len(d) > 0 {
					changes[k] = d
				}
			}
			for k := range kind {
				if objs[k] == nil {
					changes[k] = []string{"removed"}
				}
			}
			slices.Sort(added)
			if !slices.Equal(added, o.adds) {
				t.Errorf("adds\n  %v\nwant\n  %v", added, o.adds)
			}
			if len(changes)+len(o.changes) > 0 && !reflect.DeepEqual(changes, o.changes) {
				t.Errorf("changes %v, want %v", changes, o.changes)
			}
		})
	}
}

// TestAdmissionPoliciesOnlyWhereServed: the chart renders each admission policy (the
// node-label policy, the node-write policy) for a cluster that serves its kind, and leaves it
// out for an older one (helm would otherwise refuse the whole install) and when its value's
// enabled is false; everything else stays the same.
func TestAdmissionPoliciesOnlyWhereServed(t *testing.T) {
	_, helm := tools(t)
	all := []string{MutatingAdmissionPolicyAPI, ValidatingAdmissionPolicyAPI}
	for _, p := range []struct{ api, value, kind, name string }{
		{MutatingAdmissionPolicyAPI, "nodeLabelPolicy", "MutatingAdmissionPolicy", "dirpv-node-label"},
		{ValidatingAdmissionPolicyAPI, "nodeWritePolicy", "ValidatingAdmissionPolicy", "dirpv-node-writes"},
	} {
		policy := []string{p.kind + " /" + p.name, p.kind + "Binding /" + p.name}
		served := helmObjs(t, helm, nil)
		for _, k := range policy {
			if served[k] == nil {
				t.Errorf("helm template for a cluster that serves %s lacks %s", p.api, k)
			}
		}
		out, err := HelmTemplateFor(t.Context(), helm, "dirpv", slices.DeleteFunc(slices.Clone(all), func(a string) bool { return a == p.api }), nil)
		must(t, err)
		for name, objs := range map[string]objects{"a cluster without " + p.api: decode(t, out), p.value + ".enabled=false": helmObjs(t, helm, nil, p.value+".enabled=false")} {
			for _, k := range policy {
				if objs[k] != nil {
					t.Errorf("helm template for %s renders %s", name, k)
				}
				delete(served, k)
			}
			if !reflect.DeepEqual(objs.keys(), served.keys()) {
				t.Errorf("helm template for %s: objects %v, want %v", name, objs.keys(), served.keys())
			}
		}
	}
}

// TestNodeWritePolicyScopesTheNodeServiceAccount: both overlays and the chart (in another
// namespace too) install the node-write policy, failing closed, and it matches exactly the
// service account the node DaemonSet runs as: a policy naming another one would scope
// nothing, silently.
func TestNodeWritePolicyScopesTheNodeServiceAccount(t *testing.T) {
	kustomize, helm := tools(t)
	renders := map[string]objects{
		"deploy/overlays/kind": kustomizeObjs(t, kustomize, "deploy/overlays/kind"),
		"deploy/overlays/nfs":  kustomizeObjs(t, kustomize, "deploy/overlays/nfs"),
	}
	out, err := HelmTemplate(t.Context(), helm, "storage", nil)
	must(t, err)
	renders["helm -n storage"] = decode(t, out)
	namespaces := map[string]string{"helm -n storage": "storage"}
	for name, objs := range renders {
		ns := cmp.Or(namespaces[name], "dirpv")
		ds := get[*appsv1.DaemonSet](t, objs, "DaemonSet "+ns+"/dirpv-node")
		want := "request.userInfo.username == 'system:serviceaccount:" + ds.Namespace + ":" + ds.Spec.Template.Spec.ServiceAccountName + "'"
		policy := objs["ValidatingAdmissionPolicy /dirpv-node-writes"]
		binding := objs["ValidatingAdmissionPolicyBinding /dirpv-node-writes"]
		if policy == nil || binding == nil {
			t.Errorf("%s: no node-write policy and binding", name)
			continue
		}
		if fp, _, _ := unstructured.NestedString(policy.Object, "spec", "failurePolicy"); fp != "Fail" {
			t.Errorf("%s: failurePolicy %q, want Fail", name, fp)
		}
		conds, _, _ := unstructured.NestedSlice(policy.Object, "spec", "matchConditions")
		if len(conds) != 1 || conds[0].(map[string]any)["expression"] != want {
			t.Errorf("%s: matchConditions %v, want the one expression %s", name, conds, want)
		}
		if actions, _, _ := unstructured.NestedStringSlice(binding.Object, "spec", "validationActions"); !slices.Equal(actions, []string{"Deny"}) {
			t.Errorf("%s: binding's validationActions %v, want [Deny]", name, actions)
		}
	}
}

// sameObjects fails unless kustomize's and helm's renders are the same objects, field for
// field, but for Helm's own labels (which it removes from chart). helm creates a chart's CRDs
// from crds/ as vendored (TestSnapshotCRDsAreUpstream) and leaves them alone after, so they
// carry no label of the release; kustomize's are labelled as dirpv's other objects (which it
// removes from kind's CRDs).
func sameObjects(t *testing.T, kind, chart objects) {
	t.Helper()
	for k, u := range chart {
		if u.GetKind() == "CustomResourceDefinition" {
			if len(u.GetLabels()) > 0 {
				t.Errorf("helm %s has labels %v; want crds/ as vendored", k, u.GetLabels())
			}
			if kind[k] != nil {
				kind[k].SetLabels(nil)
			}
			continue
		}
		labels := u.GetLabels()
		for _, l := range helmOnlyLabels {
			if _, ok := labels[l]; !ok {
				t.Errorf("helm %s lacks label %s", key(u), l)
			}
			delete(labels, l)
		}
		u.SetLabels(labels)
	}
	if !reflect.DeepEqual(kind.keys(), chart.keys()) {
		t.Fatalf("different objects:\nkustomize: %v\nhelm:      %v", kind.keys(), chart.keys())
	}
	for _, k := range kind.keys() {
		if d := diff("", kind[k].Object, chart[k].Object); len(d) > 0 {
			t.Errorf("%s differs (kustomize != helm):\n  %s", k, strings.Join(d, "\n  "))
		}
	}
}

// TestControllerHostNetwork: the option for NFS exports restricted to node addresses, which
// puts the controller on the node's network with cluster DNS (TestHelmMatchesKustomize), gives
// it a port that is not the node plugin's (the chart refuses values that would not:
// TestHelmRejects).
func TestControllerHostNetwork(t *testing.T) {
	kustomize, _ := tools(t)
	// An overlay as deploy/README.md tells a user to write: kind plus the component.
	withComponent := kustomizeObjs(t, kustomize, "test/deploy/testdata/controller-host-network")
	spec := deployment(t, withComponent).Spec.Template.Spec
	if c, n := httpPort(container(t, spec)), httpPort(container(t, daemonSet(t, withComponent).Spec.Template.Spec)); c == 0 || c == n {
		t.Errorf("controller's http port %d, node plugin's %d: want two ports on the host network", c, n)
	}
}

// variants are every rendering a user can install; each must satisfy the checks below.
func variants(t *testing.T) map[string]objects {
	kustomize, helm := tools(t)
	return map[string]objects{
		"kustomize kind":      kustomizeObjs(t, kustomize, "deploy/overlays/kind"),
		"kustomize nfs":       kustomizeObjs(t, kustomize, "deploy/overlays/nfs"),
		"kustomize e2e-local": kustomizeObjs(t, kustomize, "deploy/overlays/e2e-local"),
		"helm defaults":       helmObjs(t, helm, nil),
		"helm custom":         helmObjs(t, helm, []string{"testdata/custom-values.yaml"}),
	}
}

// TestVariants runs, on each variant, rendered once, the checks every rendering a user can
// install must pass.
func TestVariants(t *testing.T) {
	checks := map[string]func(t *testing.T, variant string, objs objects){
		"ObjectsAreValid": checkObjectsAreValid, "RBACLeastPrivilege": checkRBACLeastPrivilege, "CSIDriver": checkCSIDriver,
		"ControllerDeployment": checkControllerDeployment, "NodeDaemonSet": checkNodeDaemonSet, "StorageClasses": checkStorageClasses,
		"ImagesArePinned": checkImagesArePinned, "ControllerPDB": checkControllerPDB, "MetricsServices": checkMetricsServices,
		"NoServiceMonitor": checkNoServiceMonitor,
	}
	for name, objs := range variants(t) {
		for check, f := range checks {
			t.Run(name+"/"+check, func(t *testing.T) { f(t, name, objs) })
		}
	}
}

// checkObjectsAreValid: every rendered object converts to its API type with no unknown field.
func checkObjectsAreValid(t *testing.T, name string, objs objects) {
	for _, k := range objs.keys() {
		// The snapshot option's CRDs and classes are not client-go types; the CRDs are
		// upstream's (TestSnapshotCRDsAreUpstream).
		if kind := objs[k].GetKind(); kind == "CustomResourceDefinition" || kind == "VolumeSnapshotClass" {
			continue
		}
		typed(t, objs[k])
	}
	for _, want := range []string{"CSIDriver /dirpv.io", "ServiceAccount dirpv/dirpv-node", "DaemonSet dirpv/dirpv-node",
		"ServiceAccount dirpv/dirpv-controller", "Deployment dirpv/dirpv-controller"} {
		if objs[want] == nil {
			t.Errorf("missing %s", want)
		}
	}
}

// The rules each role must have, no more: the verbs sig-storage-lib-external-provisioner v13
// and dirpv call (see deploy/base/rbac-*.yaml for which call needs which).
var wantRules = map[string][]rbacv1.PolicyRule{
	"ClusterRole dirpv-controller": {
		{APIGroups: []string{""}, Resources: []string{"persistentvolumes"}, Verbs: []string{"get", "list", "watch", "create", "delete", "patch"}},
		// patch: route labels local claims with their node.
		{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims"}, Verbs: []string{"get", "list", "watch", "update", "patch"}},
		// external-resizer's controller: a resize's conditions, allocatedResources, capacity.
		{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"storageclasses"}, Verbs: []string{"get", "list", "watch"}},
		// Provisioner.nodeLost: is a released local PV's node gone? placeAdopted: which node has
		// an adopted local PV's hostname?
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list"}},
		// Provisioner.checkNodePlugin: does a local claim's node run dirpv's node plugin?
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"csinodes"}, Verbs: []string{"get"}},
		// driverOwner: the CSIDriver owns the controller's CSIStorageCapacity objects.
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"csidrivers"}, ResourceNames: []string{"dirpv.io"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		snapshotRules[0], snapshotRules[1], snapshotRules[2], snapshotRules[3],
	},
	// The capacity controller (external-provisioner's pkg/capacity) watches, creates, updates
	// and deletes its own objects in dirpv's namespace, and never gets one.
	"Role dirpv-controller-capacity": capacityRules,
	"Role dirpv-node-capacity":       capacityRules,
	"Role dirpv-controller-leader-election": {
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"create"}},
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, ResourceNames: []string{"dirpv.io"}, Verbs: []string{"get", "update"}},
	},
	"ClusterRole dirpv-node": {
		{APIGroups: []string{""}, Resources: []string{"persistentvolumes"}, Verbs: []string{"get", "list", "watch", "create", "delete", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims"}, Verbs: []string{"get", "list", "watch", "update"}},
		// external-resizer's controller: a resize's conditions, allocatedResources, capacity.
		{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"storageclasses"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		snapshotRules[0], snapshotRules[1], snapshotRules[2], snapshotRules[3],
	},
}

// snapshotRules are the in-process sidecar controller's (external-snapshotter's
// pkg/sidecar-controller) and restore's, in the controller (NFS) and each node (local).
var snapshotRules = []rbacv1.PolicyRule{
	{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotclasses"}, Verbs: []string{"get", "list", "watch"}},
	{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotcontents"}, Verbs: []string{"get", "list", "watch", "update", "patch"}},
	{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotcontents/status"}, Verbs: []string{"update", "patch"}},
	{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshots"}, Verbs: []string{"get"}},
}

var capacityRules = []rbacv1.PolicyRule{
	{APIGroups: []string{"storage.k8s.io"}, Resources: []string{"csistoragecapacities"}, Verbs: []string{"list", "watch", "create", "update", "delete"}},
}

func checkRBACLeastPrivilege(t *testing.T, name string, objs objects) {
	roles := map[string]bool{}
	for _, kind := range []string{"ClusterRole", "Role"} {
		for _, n := range objs.ofKind(kind) {
			roles[kind+" "+n] = true
		}
	}
	all := maps.Clone(wantRules)
	if objs["ClusterRole /dirpv-snapshot-controller"] != nil {
		// The snapshots option (e2e-local has it).
		maps.Copy(all, snapshotControllerRules)
	}
	for role, want := range all {
		if !roles[role] {
			t.Errorf("missing %s", role)
			continue
		}
		delete(roles, role)
		var got []rbacv1.PolicyRule
		if kind, n, _ := strings.Cut(role, " "); kind == "ClusterRole" {
			got = get[*rbacv1.ClusterRole](t, objs, "ClusterRole /"+n).Rules
		} else {
			got = get[*rbacv1.Role](t, objs, "Role dirpv/"+n).Rules
		}
		var g, w []string
		for _, r := range got {
			g = append(g, joinRule(r))
			for _, s := range append(append(append([]string(nil), r.Verbs...), r.Resources...), r.APIGroups...) {
				if s == "*" {
					t.Errorf("%s: wildcard in %s", role, joinRule(r))
				}
			}
			for _, res := range r.Resources {
				// The subresources: external-resizer's controller patches claims' status,
				// the snapshot sidecar its contents'.
				if res == "secrets" || res == "configmaps" || (strings.Contains(res, "/") &&
					res != "persistentvolumeclaims/status" && res != "volumesnapshotcontents/status" && res != "volumesnapshots/status") {
					t.Errorf("%s: needs no %s", role, res)
				}
			}
			for _, v := range r.Verbs {
				if v == "escalate" || v == "bind" || v == "impersonate" || v == "deletecollection" {
					t.Errorf("%s: verb %s", role, v)
				}
			}
		}
		for _, r := range want {
			w = append(w, joinRule(r))
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s rules:\n got  %v\n want %v", role, g, w)
		}
	}
	for extra := range roles {
		t.Errorf("unexpected %s", extra)
	}
	// Each binding grants its role to the component's own service account only.
	binds := map[string]string{
		"ClusterRoleBinding /dirpv-controller":               "dirpv-controller",
		"ClusterRoleBinding /dirpv-node":                     "dirpv-node",
		"RoleBinding dirpv/dirpv-controller-leader-election": "dirpv-controller",
		"RoleBinding dirpv/dirpv-controller-capacity":        "dirpv-controller",
		"RoleBinding dirpv/dirpv-node-capacity":              "dirpv-node",
	}
	if objs["ClusterRole /dirpv-snapshot-controller"] != nil {
		binds["ClusterRoleBinding /dirpv-snapshot-controller"] = "dirpv-snapshot-controller"
		binds["RoleBinding dirpv/dirpv-snapshot-controller-leader-election"] = "dirpv-snapshot-controller"
	}
	for k, sa := range binds {
		var subjects []rbacv1.Subject
		var ref rbacv1.RoleRef
		if strings.HasPrefix(k, "Cluster") {
			b := get[*rbacv1.ClusterRoleBinding](t, objs, k)
			subjects, ref = b.Subjects, b.RoleRef
		} else {
			b := get[*rbacv1.RoleBinding](t, objs, k)
			subjects, ref = b.Subjects, b.RoleRef
		}
		want := []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: "dirpv"}}
		if !reflect.DeepEqual(subjects, want) {
			t.Errorf("%s subjects %+v, want %+v", k, subjects, want)
		}
		if _, name, _ := strings.Cut(k, "/"); ref.Name != name {
			t.Errorf("%s binds %s", k, ref.Name)
		}
	}
	if sa := deployment(t, objs).Spec.Template.Spec.ServiceAccountName; sa != "dirpv-controller" {
		t.Errorf("controller runs as %q", sa)
	}
	if sa := daemonSet(t, objs).Spec.Template.Spec.ServiceAccountName; sa != "dirpv-node" {
		t.Errorf("node runs as %q", sa)
	}
}

func checkCSIDriver(t *testing.T, name string, objs objects) {
	d := get[*storagev1.CSIDriver](t, objs, "CSIDriver /dirpv.io")
	f, tr := false, true
	file := storagev1.FileFSGroupPolicy
	want := storagev1.CSIDriverSpec{
		AttachRequired:       &f,
		PodInfoOnMount:       &tr,
		FSGroupPolicy:        &file,
		VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
		RequiresRepublish:    &f,
		// The scheduler checks CSIStorageCapacity for WaitForFirstConsumer claims.
		StorageCapacity: &tr,
	}
	if !reflect.DeepEqual(d.Spec, want) {
		t.Errorf("CSIDriver spec %+v, want %+v", d.Spec, want)
	}
}

// checkProbes checks that both probes hit /healthz on the port the process serves
// (--http-address), and that the container requests cpu and memory and limits memory.
func checkProbes(t *testing.T, what string, c corev1.Container) {
	t.Helper()
	var addr string
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--http-address="); ok {
			addr = v
		}
	}
	if addr == "" {
		t.Errorf("%s: no --http-address in %v", what, c.Args)
		return
	}
	if port := httpPort(c); fmt.Sprintf(":%d", port) != addr {
		t.Errorf("%s: port http %d but --http-address=%s", what, httpPort(c), addr)
	}
	for pname, p := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		if p == nil || p.HTTPGet == nil {
			t.Errorf("%s: no HTTP %s probe", what, pname)
			continue
		}
		if p.HTTPGet.Path != "/healthz" || p.HTTPGet.Port != intstr.FromString("http") {
			t.Errorf("%s: %s probe %+v", what, pname, p.HTTPGet)
		}
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("%s: resources %+v: want cpu and memory requests and a memory limit", what, c.Resources)
	}
}

func checkControllerDeployment(t *testing.T, name string, objs objects) {
	d := deployment(t, objs)
	spec := d.Spec.Template.Spec
	c := container(t, spec)
	if len(c.Args) == 0 || c.Args[0] != "controller" {
		t.Errorf("args %v", c.Args)
	}
	for _, a := range c.Args {
		if strings.HasPrefix(a, "--leader-election=false") || strings.HasPrefix(a, "--kubeconfig") {
			t.Errorf("arg %s: the controller must run in-cluster with leader election", a)
		}
	}
	if e, ok := envValue(c, "POD_NAMESPACE"); !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.namespace" {
		t.Errorf("POD_NAMESPACE %+v", e)
	}
	checkProbes(t, "controller", c)
	// A leader killed before it has drained and unmounted keeps the lease, and the
	// standby waits out the lease duration: the grace period covers a worker's
	// --operation-timeout (30 s) plus the bounded unmounts (~50 s with dead servers).
	if g := spec.TerminationGracePeriodSeconds; g == nil || *g < 80 {
		t.Errorf("terminationGracePeriodSeconds %v, want at least 80", g)
	}
	// The controller's NFS mounts live in its own mount namespace: nothing of the host.
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			t.Errorf("controller has hostPath volume %s (%s)", v.Name, v.HostPath.Path)
		}
	}
	for _, m := range c.VolumeMounts {
		if m.MountPropagation != nil {
			t.Errorf("controller mount %s has propagation %s", m.Name, *m.MountPropagation)
		}
	}
	if spec.HostPID || spec.HostIPC {
		t.Error("controller shares host PID or IPC namespace")
	}
	sc := c.SecurityContext
	if sc == nil || sc.Capabilities == nil {
		t.Fatal("controller has no securityContext with capabilities")
	}
	if sc.Privileged != nil && *sc.Privileged {
		t.Error("controller is privileged; CAP_SYS_ADMIN is enough for NFS mounts")
	}
	if !reflect.DeepEqual(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("drop %v, want [ALL]", sc.Capabilities.Drop)
	}
	allowed := map[corev1.Capability]bool{"SYS_ADMIN": true, "CHOWN": true, "FOWNER": true, "DAC_OVERRIDE": true, "NET_BIND_SERVICE": true}
	for _, c := range sc.Capabilities.Add {
		if !allowed[c] {
			t.Errorf("controller adds capability %s", c)
		}
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("controller root filesystem is writable")
	}
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccomp %+v", sc.SeccompProfile)
	}
	if !strings.HasPrefix(c.Image, "ghcr.io/dirpv/dirpv:") {
		t.Errorf("image %s", c.Image)
	}
}

func checkNodeDaemonSet(t *testing.T, name string, objs objects) {
	ds := daemonSet(t, objs)
	spec := ds.Spec.Template.Spec
	c := container(t, spec)
	if len(c.Args) == 0 || c.Args[0] != "node" {
		t.Fatalf("args %v", c.Args)
	}
	root := "/var/lib/kubelet"
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--kubelet-root-dir="); ok {
			root = v
		}
		if strings.HasPrefix(a, "--csi-endpoint") || strings.HasPrefix(a, "--plugin-registration-dir") {
			t.Errorf("arg %s: the defaults under --kubelet-root-dir are what the volumes mount", a)
		}
	}
	if e, ok := envValue(c, "NODE_NAME"); !ok || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("NODE_NAME %+v", e)
	}
	checkProbes(t, "node", c)
	if sc := c.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
		t.Error("node plugin not privileged: Bidirectional propagation needs it")
	}
	if !spec.HostNetwork {
		t.Error("node plugin not on the host network: NFS mounts would lose their network with the pod")
	}
	if len(spec.Tolerations) != 1 || spec.Tolerations[0].Operator != corev1.TolerationOpExists || spec.Tolerations[0].Key != "" {
		t.Errorf("tolerations %+v: want one that tolerates every taint", spec.Tolerations)
	}

	hostPaths := map[string]string{} // volume name -> host path
	for _, v := range spec.Volumes {
		if v.HostPath != nil {
			hostPaths[v.Name] = v.HostPath.Path
		}
	}
	mounts := map[string]corev1.VolumeMount{} // host path -> mount
	for _, m := range c.VolumeMounts {
		hp, ok := hostPaths[m.Name]
		if !ok {
			continue
		}
		if hp != m.MountPath {
			t.Errorf("volume %s: host %s mounted at %s; kubelet passes host paths, so they must match", m.Name, hp, m.MountPath)
		}
		mounts[hp] = m
	}
	propagation := func(p string) corev1.MountPropagationMode {
		m, ok := mounts[p]
		if !ok {
			t.Errorf("%s not mounted (have %v)", p, mounts)
			return ""
		}
		if m.MountPropagation == nil {
			return corev1.MountPropagationNone
		}
		return *m.MountPropagation
	}
	if p := propagation(root + "/pods"); p != corev1.MountPropagationBidirectional {
		t.Errorf("%s/pods propagation %q, want Bidirectional (pods' target paths live there)", root, p)
	}
	propagation(root + "/plugins/dirpv.io")
	propagation(root + "/plugins_registry")
	// Host mounts must not nest: a mount below a Bidirectional one propagates back to the
	// host and accumulates there on every restart.
	for a := range mounts {
		for b := range mounts {
			if a != b && strings.HasPrefix(b+"/", a+"/") {
				t.Errorf("host path %s is mounted inside %s", b, a)
			}
		}
	}
	// Every local class's basePath must be visible to the node plugin at the same path.
	for _, sc := range storageClasses(t, objs) {
		if sc.Parameters["backend"] != "local" {
			continue
		}
		bp := sc.Parameters["basePath"]
		if bp == "" {
			bp = "/var/lib/dirpv"
		}
		if p := propagation(bp); p == corev1.MountPropagationNone {
			t.Errorf("class %s basePath %s propagation None: a disk mounted there later would stay hidden", sc.Name, bp)
		}
	}
	checkAllowedBases(t, c, spec, root, storageClasses(t, objs))
}

// checkAllowedBases: the node plugin is told to allow exactly the base paths its DaemonSet
// mounts, none of them under kubelet's root dir, and every local class's basePath is at or
// beneath one of them (otherwise its claims fail with "local volume refused").
func checkAllowedBases(t *testing.T, c corev1.Container, spec corev1.PodSpec, kubeletRoot string, classes map[string]*storagev1.StorageClass) {
	t.Helper()
	var allowed []string
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(a, "--allowed-base-paths="); ok {
			allowed = strings.Split(v, ",")
		}
	}
	var mounted []string
	for _, v := range spec.Volumes {
		if strings.HasPrefix(v.Name, "base-path") && v.HostPath != nil {
			mounted = append(mounted, v.HostPath.Path)
		}
	}
	slices.Sort(allowed)
	slices.Sort(mounted)
	if len(allowed) == 0 || !slices.Equal(allowed, mounted) {
		t.Errorf("--allowed-base-paths %v, want exactly the mounted base paths %v", allowed, mounted)
	}
	for _, b := range allowed {
		if volume.Within(b, kubeletRoot) {
			t.Errorf("allowed base %s is inside kubelet's root dir %s", b, kubeletRoot)
		}
	}
	for _, sc := range classes {
		if sc.Parameters["backend"] != "local" {
			continue
		}
		bp := sc.Parameters["basePath"]
		if bp == "" {
			bp = provisioner.DefaultBasePath
		}
		if !slices.ContainsFunc(allowed, func(b string) bool { return volume.Within(bp, b) }) {
			t.Errorf("class %s basePath %s is not at or beneath an allowed base %v", sc.Name, bp, allowed)
		}
	}
}

func checkStorageClasses(t *testing.T, name string, objs objects) {
	defaults := 0
	for _, sc := range storageClasses(t, objs) {
		if sc.Provisioner != "dirpv.io" {
			t.Errorf("%s provisioner %s", sc.Name, sc.Provisioner)
		}
		if sc.Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
			defaults++
		}
		mode := storagev1.VolumeBindingImmediate
		if sc.VolumeBindingMode != nil {
			mode = *sc.VolumeBindingMode
		}
		switch sc.Parameters["backend"] {
		case "local":
			if mode != storagev1.VolumeBindingWaitForFirstConsumer {
				t.Errorf("local class %s binding %s", sc.Name, mode)
			}
		case "nfs":
			if sc.Parameters["server"] == "" || sc.Parameters["share"] == "" || strings.HasSuffix(sc.Parameters["server"], ".invalid") {
				t.Errorf("nfs class %s export %s:%s", sc.Name, sc.Parameters["server"], sc.Parameters["share"])
			}
		default:
			t.Errorf("%s backend %q", sc.Name, sc.Parameters["backend"])
		}
		checkParameters(t, sc)
		// helm custom turns it off on one class (TestHelmCustomValues).
		if name != "helm custom" && (sc.AllowVolumeExpansion == nil || !*sc.AllowVolumeExpansion) {
			t.Errorf("class %s does not allow volume expansion", sc.Name)
		}
	}
	if defaults > 1 {
		t.Errorf("%d default classes", defaults)
	}
}

// TestKindOverlay pins what the kind overlay promises beyond its default class dirpv-local
// (test/e2e/install TestDefaultClassIsDirpvLocal, on the installed release's kind manifest).
func TestKindOverlay(t *testing.T) {
	kustomize, _ := tools(t)
	objs := kustomizeObjs(t, kustomize, "deploy/overlays/kind")
	if ns := get[*corev1.Namespace](t, objs, "Namespace /dirpv"); ns.Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("namespace labels %v", ns.Labels)
	}
	if r := deployment(t, objs).Spec.Replicas; r == nil || *r != 2 {
		t.Errorf("controller replicas %v, want 2", r)
	}
	// kubectl apply -k gets the release the chart installs by default.
	want := "ghcr.io/dirpv/dirpv:" + chartAppVersion(t)
	for _, c := range []corev1.Container{container(t, deployment(t, objs).Spec.Template.Spec), container(t, daemonSet(t, objs).Spec.Template.Spec)} {
		if c.Image != want || c.ImagePullPolicy != corev1.PullIfNotPresent {
			t.Errorf("image %s pull %s: want %s, IfNotPresent (kind load image-archive)", c.Image, c.ImagePullPolicy, want)
		}
	}
}

func TestNFSOverlay(t *testing.T) {
	kustomize, _ := tools(t)
	objs := kustomizeObjs(t, kustomize, "deploy/overlays/nfs")
	sc := get[*storagev1.StorageClass](t, objs, "StorageClass /dirpv-nfs")
	if sc.Parameters["server"] != "nfs.example.com" || sc.Parameters["share"] != "/srv/nfs/dirpv" {
		t.Errorf("export not patched: %v", sc.Parameters)
	}
	if *sc.VolumeBindingMode != storagev1.VolumeBindingImmediate || sc.Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
		t.Errorf("dirpv-nfs %+v", sc)
	}
}

// TestRenderE2ELocal: what an e2e test on test/cluster gets beyond what the e2e tier would
// fail without (every component on the host network, reaching the apiserver at the port given):
// one controller, as two on one host network collide on the port, and the test's image, never
// pulled. The e2e install of a release (E2ELocalOptions.Kind: the release's rendered kind
// overlay, RenderOverlay) installs the same objects as that of the tree with the release's
// image, so that what the install suite checks on a release is the release's manifest with
// nothing but e2e-local's adaptations.
func TestRenderE2ELocal(t *testing.T) {
	kustomize, _ := tools(t)
	const image = "ghcr.io/dirpv/dirpv@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	onTree, err := RenderE2ELocal(t.Context(), kustomize, E2ELocalOptions{APIServerPort: 36443, Image: image})
	must(t, err)
	tree := decode(t, onTree)
	if d := deployment(t, tree); *d.Spec.Replicas != 1 {
		t.Errorf("controller replicas %d: two on one host network collide on the port", *d.Spec.Replicas)
	}
	for name, spec := range map[string]corev1.PodSpec{"controller": deployment(t, tree).Spec.Template.Spec, "node": daemonSet(t, tree).Spec.Template.Spec,
		"snapshot-controller": get[*appsv1.Deployment](t, tree, "Deployment dirpv/dirpv-snapshot-controller").Spec.Template.Spec} {
		if c := container(t, spec); c.Image != image || c.ImagePullPolicy != corev1.PullNever {
			t.Errorf("%s: image %s pull %s", name, c.Image, c.ImagePullPolicy)
		}
	}
	kind, err := RenderOverlay(t.Context(), kustomize, "kind", image)
	must(t, err)
	onRelease, err := RenderE2ELocal(t.Context(), kustomize, E2ELocalOptions{APIServerPort: 36443, Image: image, Kind: kind})
	must(t, err)
	rel := decode(t, onRelease)
	if !reflect.DeepEqual(rel.keys(), tree.keys()) {
		t.Errorf("e2e-local on the rendered kind overlay has %v, on the tree %v", rel.keys(), tree.keys())
	}
	for k := range tree {
		if rel[k] == nil {
			continue
		}
		if d := diff("", tree[k].Object, rel[k].Object); len(d) > 0 {
			t.Errorf("%s differs (on the tree != on the release):\n  %s", k, strings.Join(d, "\n  "))
		}
	}
}

// checkImagesArePinned: no variant a user installs, the e2e install included, runs an image by
// "latest" or without a tag (which means latest): a node that already has an image under such
// a name keeps running it, whatever was released since.
func checkImagesArePinned(t *testing.T, name string, objs objects) {
	n := 0
	for _, k := range objs.keys() {
		for _, img := range images(objs[k].Object) {
			n++
			if _, _, _, err := splitImage(img); err != nil {
				t.Errorf("%s: %v", k, err)
			}
		}
	}
	if n < 2 {
		t.Errorf("found %d images, want at least the controller's and the node's", n)
	}
}

// images returns the image of every container, init container and ephemeral container found
// anywhere in obj, so that any workload kind is covered.
func images(obj any) []string {
	var out []string
	switch v := obj.(type) {
	case map[string]any:
		for k, child := range v {
			if list, ok := child.([]any); ok && (k == "containers" || k == "initContainers" || k == "ephemeralContainers") {
				for _, c := range list {
					if m, ok := c.(map[string]any); ok {
						img, _ := m["image"].(string)
						out = append(out, img)
					}
				}
			}
			out = append(out, images(child)...)
		}
	case []any:
		for _, child := range v {
			out = append(out, images(child)...)
		}
	}
	return out
}

// TestHelmCustomValues: the values kind does not exercise reach the right fields.
func TestHelmCustomValues(t *testing.T) {
	_, helm := tools(t)
	objs := helmObjs(t, helm, []string{"testdata/custom-values.yaml"})
	if objs["Namespace /dirpv"] != nil {
		t.Error("Namespace rendered although namespace.create is false")
	}
	classes := storageClasses(t, objs)
	if got := objs.ofKind("StorageClass"); !reflect.DeepEqual(got, []string{"bulk", "fast", "shared"}) {
		t.Fatalf("classes %v", got)
	}
	wantParams := map[string]map[string]string{
		"fast":   {"backend": "local", "basePath": "/mnt/ssd/dirpv", "onDelete": "archive", "capacityEnforcement": "required", "mode": "0770", "uid": "1000", "gid": "1000"},
		"bulk":   {"backend": "local", "basePath": "/srv/dirpv", "pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.name}"},
		"shared": {"backend": "nfs", "server": "nfs.example.com", "share": "/srv/nfs", "onDelete": "retain"},
	}
	for name, want := range wantParams {
		if !reflect.DeepEqual(classes[name].Parameters, want) {
			t.Errorf("%s parameters %v, want %v", name, classes[name].Parameters, want)
		}
	}
	if !reflect.DeepEqual(classes["shared"].MountOptions, []string{"nfsvers=4.1", "hard"}) || *classes["shared"].VolumeBindingMode != storagev1.VolumeBindingImmediate {
		t.Errorf("shared %+v", classes["shared"])
	}
	if classes["fast"].Annotations["storageclass.kubernetes.io/is-default-class"] != "true" || classes["bulk"].Annotations != nil {
		t.Error("default class annotation on the wrong class")
	}
	for name, want := range map[string]bool{"fast": true, "bulk": false, "shared": true} {
		if got := classes[name].AllowVolumeExpansion; got == nil || *got != want {
			t.Errorf("%s allowVolumeExpansion %v, want %v (default true, bulk turns it off)", name, got, want)
		}
	}
	d := deployment(t, objs)
	if *d.Spec.Replicas != 3 || !d.Spec.Template.Spec.HostNetwork {
		t.Errorf("controller replicas %d hostNetwork %v", *d.Spec.Replicas, d.Spec.Template.Spec.HostNetwork)
	}
	if e, _ := envValue(container(t, d.Spec.Template.Spec), "KUBERNETES_SERVICE_HOST"); e.Value != "127.0.0.1" {
		t.Errorf("extraEnv not applied: %+v", e)
	}
	const adopt = "--adopt-provisioners=cluster.local/nfs-subdir-external-provisioner,rancher.io/local-path"
	if args := container(t, d.Spec.Template.Spec).Args; !slices.Contains(args, "--operation-timeout=1m") || !slices.Contains(args, adopt) {
		t.Errorf("controller args %v lack extraArgs' --operation-timeout=1m or adoptProvisioners' %s", args, adopt)
	}
	c := container(t, daemonSet(t, objs).Spec.Template.Spec)
	if !slices.Contains(c.Args, "--kubelet-root-dir=/data/kubelet") || !slices.Contains(c.Args, "--allowed-base-paths=/srv/dirpv,/mnt/ssd/dirpv") ||
		!slices.Contains(c.Args, "--quota-check-period=1m") || !slices.Contains(c.Args, adopt) {
		t.Errorf("node args %v", c.Args)
	}
	var paths []string
	for _, m := range c.VolumeMounts {
		paths = append(paths, m.MountPath)
	}
	for _, want := range []string{"/data/kubelet/pods", "/data/kubelet/plugins/dirpv.io", "/data/kubelet/plugins_registry", "/srv/dirpv", "/mnt/ssd/dirpv"} {
		if !slices.Contains(paths, want) {
			t.Errorf("node mounts %v lack %s", paths, want)
		}
	}
}

// TestHelmRejects: values that would give a class dirpv refuses fail at render time instead.
func TestHelmRejects(t *testing.T) {
	_, helm := tools(t)
	cases := map[string]struct {
		set  []string
		want string
	}{
		"local Immediate":  {[]string{"storageClasses[0].name=x", "storageClasses[0].volumeBindingMode=Immediate"}, "WaitForFirstConsumer"},
		"nfs no share":     {[]string{"nfs.exports[0].name=n", "nfs.exports[0].server=s"}, "needs server and share"},
		"nfs no ctrl":      {[]string{"nfs.exports[0].name=n", "nfs.exports[0].server=s", "nfs.exports[0].share=/x", "controller.enabled=false"}, "controller.enabled"},
		"base in kubelet":  {[]string{"node.allowedBasePaths[0]=/var/lib/kubelet/pods"}, "inside kubeletRootDir"},
		"class in kubelet": {[]string{"storageClasses[0].name=x", "storageClasses[0].basePath=/var/lib/kubelet"}, "inside kubeletRootDir"},
		// values.schema.json catches these before the templates do.
		"bad backend":             {[]string{"storageClasses[0].name=x", "storageClasses[0].backend=ceph"}, "'local', 'nfs'"},
		"typo":                    {[]string{"controller.replicaz=3"}, "replicaz"},
		"bad onDelete":            {[]string{"storageClasses[0].name=x", "storageClasses[0].onDelete=trash"}, "onDelete"},
		"bad capacityEnforcement": {[]string{"storageClasses[0].name=x", "storageClasses[0].capacityEnforcement=always"}, "capacityEnforcement"},
		// --set on a list index replaces the whole default list: this entry has no name.
		"no name":    {[]string{"storageClasses[0].backend=local"}, "needs a name"},
		"latest tag": {[]string{"image.tag=latest"}, "latest refused"},
		"bad tag":    {[]string{"image.tag=v1/x"}, "does not match pattern"},
		// A flag's value without its name would be taken for a positional argument.
		"bare arg": {[]string{"node.extraArgs[0]=1m"}, "does not match pattern"},
		// 0 blocks every drain.
		"PDB maxUnavailable 0":            {[]string{"controller.podDisruptionBudget.maxUnavailable=0"}, "maxUnavailable"},
		"same ports on the host network":  {[]string{"controller.hostNetwork=true", "node.httpPort=9809"}, "would collide"},
		"ServiceMonitor without Services": {[]string{"metrics.serviceMonitor.enabled=true", "metrics.service.enabled=false"}, "needs metrics.service.enabled"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := HelmTemplate(t.Context(), helm, "dirpv", nil, tc.set...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// checkParameters mirrors provisioner's parameter rules for the values a manifest can get wrong
// without any cluster noticing until a claim fails.
func checkParameters(t *testing.T, sc *storagev1.StorageClass) {
	t.Helper()
	known := map[string]bool{}
	for _, p := range []string{provisioner.ParamBackend, provisioner.ParamServer, provisioner.ParamShare, provisioner.ParamBasePath,
		provisioner.ParamPathPattern, provisioner.ParamOnDelete, provisioner.ParamMode, provisioner.ParamUID, provisioner.ParamGID,
		provisioner.ParamCapacityEnforcement} {
		known[p] = true
	}
	for k, v := range sc.Parameters {
		if !known[k] {
			t.Errorf("class %s: unknown parameter %s", sc.Name, k)
		}
		switch k {
		case "onDelete":
			if v != "delete" && v != "retain" && v != "archive" {
				t.Errorf("class %s: onDelete %q", sc.Name, v)
			}
		case "capacityEnforcement":
			if v != "bestEffort" && v != "required" || sc.Parameters["backend"] != "local" {
				t.Errorf("class %s: capacityEnforcement %q on backend %q", sc.Name, v, sc.Parameters["backend"])
			}
		case "basePath", "share":
			if !path.IsAbs(v) || path.Clean(v) != v {
				t.Errorf("class %s: %s %q not a clean absolute path", sc.Name, k, v)
			}
		case "mode":
			var m uint32
			if _, err := fmt.Sscanf(v, "%o", &m); err != nil || m > 0o7777 || !strings.ContainsRune("01234567", rune(v[0])) {
				t.Errorf("class %s: mode %q", sc.Name, v)
			}
		case "uid", "gid":
			var n int
			if _, err := fmt.Sscanf(v, "%d", &n); err != nil || n < 0 || fmt.Sprint(n) != v {
				t.Errorf("class %s: %s %q", sc.Name, k, v)
			}
		}
	}
	if sc.Parameters["backend"] == "local" {
		if _, ok := sc.Parameters["server"]; ok {
			t.Errorf("class %s: server on a local class", sc.Name)
		}
	}
}

// checkControllerPDB: drains take at most one controller replica at a time, the budget covers
// exactly the controller's pods, and neither one replica nor a wedged replica blocks a drain.
func checkControllerPDB(t *testing.T, name string, objs objects) {
	one := intstr.FromInt32(1)
	alwaysAllow := policyv1.AlwaysAllow
	pdb := get[*policyv1.PodDisruptionBudget](t, objs, "PodDisruptionBudget dirpv/dirpv-controller")
	want := policyv1.PodDisruptionBudgetSpec{
		MaxUnavailable:             &one,
		UnhealthyPodEvictionPolicy: &alwaysAllow,
		Selector: &metav1.LabelSelector{MatchLabels: map[string]string{
			"app.kubernetes.io/name": "dirpv", "app.kubernetes.io/component": "controller"}},
	}
	if !reflect.DeepEqual(pdb.Spec, want) {
		t.Errorf("spec %+v, want %+v", pdb.Spec, want)
	}
	sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
	must(t, err)
	for k, covers := range podsSelected(objs, sel) {
		if covers != (k == "Deployment dirpv/dirpv-controller") {
			t.Errorf("budget covers %s's pods: %v", k, covers)
		}
	}
}

// TestControllerPDB: the chart's values turn the budget off or change its maxUnavailable (never
// to 0, which blocks every drain: TestHelmRejects).
func TestControllerPDB(t *testing.T) {
	_, helm := tools(t)
	for _, set := range [][]string{{"controller.podDisruptionBudget.enabled=false"}, {"controller.enabled=false"}} {
		if objs := helmObjs(t, helm, nil, set...); len(objs.ofKind("PodDisruptionBudget")) != 0 {
			t.Errorf("--set %v: budgets %v", set, objs.ofKind("PodDisruptionBudget"))
		}
	}
	objs := helmObjs(t, helm, nil, "controller.podDisruptionBudget.maxUnavailable=50%")
	if got := get[*policyv1.PodDisruptionBudget](t, objs, "PodDisruptionBudget dirpv/dirpv-controller").Spec.MaxUnavailable; got == nil || *got != intstr.FromString("50%") {
		t.Errorf("maxUnavailable %v, want 50%%", got)
	}
}

// checkMetricsServices: each component has a headless Service whose http-metrics port reaches
// the port its pods serve /metrics on, and that selects that component's pods only.
func checkMetricsServices(t *testing.T, name string, objs objects) {
	workloads := map[string]string{"controller": "Deployment dirpv/dirpv-controller", "node": "DaemonSet dirpv/dirpv-node"}
	if got := objs.ofKind("Service"); !reflect.DeepEqual(got, []string{"dirpv-controller-metrics", "dirpv-node-metrics"}) {
		t.Fatalf("services %v", got)
	}
	for component, workload := range workloads {
		svc := get[*corev1.Service](t, objs, "Service dirpv/dirpv-"+component+"-metrics")
		if svc.Spec.ClusterIP != corev1.ClusterIPNone || svc.Spec.Type != "" {
			t.Errorf("%s: clusterIP %q type %q, want headless", svc.Name, svc.Spec.ClusterIP, svc.Spec.Type)
		}
		if svc.Labels["app.kubernetes.io/component"] != component {
			t.Errorf("%s labels %v", svc.Name, svc.Labels)
		}
		for k, selects := range podsSelected(objs, labels.SelectorFromSet(svc.Spec.Selector)) {
			if selects != (k == workload) {
				t.Errorf("%s selects %s's pods: %v", svc.Name, k, selects)
			}
		}
		var spec corev1.PodSpec
		if component == "controller" {
			spec = deployment(t, objs).Spec.Template.Spec
		} else {
			spec = daemonSet(t, objs).Spec.Template.Spec
		}
		c := container(t, spec)
		served := httpPort(c)
		want := []corev1.ServicePort{{Name: "http-metrics", Port: served, TargetPort: intstr.FromString("http"), Protocol: corev1.ProtocolTCP}}
		if !reflect.DeepEqual(svc.Spec.Ports, want) || !slices.Contains(c.Args, fmt.Sprintf("--http-address=:%d", served)) {
			t.Errorf("%s ports %+v, want %+v (args %v)", svc.Name, svc.Spec.Ports, want, c.Args)
		}
	}
}

// TestMetricsServices: the chart's values move the controller's metrics port and leave out
// the Services, or the controller's.
func TestMetricsServices(t *testing.T) {
	_, helm := tools(t)
	objs := helmObjs(t, helm, nil, "controller.httpPort=9999")
	if p := get[*corev1.Service](t, objs, "Service dirpv/dirpv-controller-metrics").Spec.Ports[0].Port; p != 9999 {
		t.Errorf("controller.httpPort=9999: service port %d", p)
	}
	if got := helmObjs(t, helm, nil, "metrics.service.enabled=false").ofKind("Service"); len(got) != 0 {
		t.Errorf("metrics.service.enabled=false: %v", got)
	}
	if got := helmObjs(t, helm, nil, "controller.enabled=false").ofKind("Service"); !reflect.DeepEqual(got, []string{"dirpv-node-metrics"}) {
		t.Errorf("controller.enabled=false: %v", got)
	}
}

// checkNoServiceMonitor: no variant renders a ServiceMonitor by default.
func checkNoServiceMonitor(t *testing.T, _ string, objs objects) {
	if got := objs.ofKind("ServiceMonitor"); len(got) != 0 {
		t.Errorf("ServiceMonitor %v by default", got)
	}
}

// TestServiceMonitor: when on, one ServiceMonitor that scrapes /metrics on http-metrics of
// exactly the metrics Services, carrying the labels a Prometheus selects by.
func TestServiceMonitor(t *testing.T) {
	_, helm := tools(t)
	objs := helmObjs(t, helm, nil, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom",
		"metrics.serviceMonitor.interval=30s")
	sm := objs["ServiceMonitor dirpv/dirpv"]
	if sm == nil {
		t.Fatalf("no ServiceMonitor among %v", objs.keys())
	}
	want := map[string]any{
		"apiVersion": "monitoring.coreos.com/v1",
		"kind":       "ServiceMonitor",
		"metadata": map[string]any{
			"name":      "dirpv",
			"namespace": "dirpv",
			"labels": map[string]any{
				"app.kubernetes.io/name": "dirpv", "app.kubernetes.io/part-of": "dirpv",
				"app.kubernetes.io/managed-by": "Helm", "helm.sh/chart": "dirpv-0.1.0", "release": "prom",
			},
		},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": map[string]any{"app.kubernetes.io/name": "dirpv", "app.kubernetes.io/part-of": "dirpv"}},
			"namespaceSelector": map[string]any{"matchNames": []any{"dirpv"}},
			"endpoints": []any{map[string]any{
				"port": "http-metrics", "path": "/metrics", "interval": "30s",
				"relabelings": []any{map[string]any{"sourceLabels": []any{"__meta_kubernetes_pod_node_name"}, "targetLabel": "node"}},
			}},
		},
	}
	if d := diff("", want, sm.Object); len(d) > 0 {
		t.Errorf("ServiceMonitor differs (want != got):\n  %s", strings.Join(d, "\n  "))
	}
	// Its selector picks exactly the metrics Services.
	var selected []string
	for _, n := range objs.ofKind("Service") {
		svc := get[*corev1.Service](t, objs, "Service dirpv/"+n)
		if labels.SelectorFromSet(labels.Set{"app.kubernetes.io/name": "dirpv", "app.kubernetes.io/part-of": "dirpv"}).Matches(labels.Set(svc.Labels)) {
			selected = append(selected, n)
		}
	}
	if !reflect.DeepEqual(selected, []string{"dirpv-controller-metrics", "dirpv-node-metrics"}) {
		t.Errorf("selects %v", selected)
	}
	// No interval: the Prometheus's own default applies.
	sm = helmObjs(t, helm, nil, "metrics.serviceMonitor.enabled=true")["ServiceMonitor dirpv/dirpv"]
	if sm == nil {
		t.Fatal("no ServiceMonitor")
	}
	endpoints, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
	if len(endpoints) != 1 {
		t.Fatalf("endpoints %v", endpoints)
	}
	if ep, _ := endpoints[0].(map[string]any); ep == nil || ep["interval"] != nil || ep["port"] != "http-metrics" {
		t.Errorf("endpoint %v: want port http-metrics and no interval", endpoints[0])
	}
}

// Node instances watch only the claims and PVs that the controller labelled with their node:
// without a controller, nothing would label them, so the chart has them watch everything.
func TestNodeWatchesAllVolumesWithoutController(t *testing.T) {
	_, helm := tools(t)
	for set, want := range map[string]bool{"controller.enabled=true": false, "controller.enabled=false": true} {
		c := container(t, daemonSet(t, helmObjs(t, helm, nil, set)).Spec.Template.Spec)
		if got := slices.Contains(c.Args, "--watch-all-volumes"); got != want {
			t.Errorf("%s: node args %v, want --watch-all-volumes %v", set, c.Args, want)
		}
	}
}
