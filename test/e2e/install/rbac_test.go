package install

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/dirpv/dirpv/test/framework"
)

// dirpv's ServiceAccounts as the API server names them.
var serviceAccounts = []string{
	"system:serviceaccount:dirpv:dirpv-controller",
	"system:serviceaccount:dirpv:dirpv-node",
	"system:serviceaccount:dirpv:dirpv-snapshot-controller",
}

// auditPolicy writes an audit policy recording every request of dirpv's ServiceAccounts and
// returns the kube-apiserver flags that enable it.
func auditPolicy(dir string) ([]string, error) {
	policy := "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n" +
		"- level: Metadata\n  users: [" + strings.Join(serviceAccounts, ", ") + "]\n- level: None\n"
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(policy), 0o644); err != nil {
		return nil, err
	}
	auditLog = filepath.Join(dir, "audit.log")
	return []string{"--audit-policy-file=" + path, "--audit-log-path=" + auditLog, "--audit-log-mode=blocking"}, nil
}

type auditEvent struct {
	Stage string `json:"stage"`
	Verb  string `json:"verb"`
	User  struct {
		Username string              `json:"username"`
		Extra    map[string][]string `json:"extra"`
	} `json:"user"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
		APIGroup    string `json:"apiGroup"`
	} `json:"objectRef"`
	Annotations    map[string]string `json:"annotations"`
	ResponseStatus *struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	} `json:"responseStatus"`
}

// nodeNameExtra is where the API server records the node of a token bound to a pod, which
// deploy/'s node-write policy scopes dirpv node's writes to.
const nodeNameExtra = "authentication.kubernetes.io/node-name"

// call is one kind of request: who asked for which verb on which resource.
type call struct{ user, group, resource, verb string }

func (c call) String() string {
	return fmt.Sprintf("%s %s %s.%s", strings.TrimPrefix(c.user, "system:serviceaccount:dirpv:"), c.verb, c.resource, c.group)
}

// Every API call dirpv's pods made during this suite (install, provisioning, a node plugin
// restart, a crash, uninstall) is compared with deploy/'s RBAC: none may have been refused,
// by RBAC or by one of deploy/'s admission policies, and grants never used are listed. Every
// call of dirpv node came with the token kubelet projected, which names the node its pod runs
// on, as the node-write policy needs. Runs after the other tests (file order), so it sees the
// whole lifecycle. The exact rules themselves are pinned in test/deploy.
func TestRBACCoversEveryCallMade(t *testing.T) {
	f, err := os.Open(auditLog)
	must(t, err)
	defer f.Close()
	used := map[call]int{}
	var refused, unbound []string
	// How the API server names deploy/'s admission policies when one refuses a request (403
	// for a denial, 422 when the policy fails to evaluate); a test's own policies may refuse.
	var policies []string
	for _, o := range inst.Objects {
		if k := o.GetKind(); k == "ValidatingAdmissionPolicy" || k == "MutatingAdmissionPolicy" {
			policies = append(policies, k+" '"+o.GetName()+"'")
		}
	}
	if len(policies) == 0 {
		t.Fatal("deploy/ installed no admission policy")
	}
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		var e auditEvent
		if err := json.Unmarshal(s.Bytes(), &e); err != nil {
			t.Fatalf("audit log: %v", err)
		}
		if e.Stage != "ResponseComplete" || e.ObjectRef == nil || !slices.Contains(serviceAccounts, e.User.Username) {
			continue
		}
		res := e.ObjectRef.Resource
		if e.ObjectRef.Subresource != "" {
			res += "/" + e.ObjectRef.Subresource
		}
		c := call{e.User.Username, e.ObjectRef.APIGroup, res, e.Verb}
		used[c]++
		if e.Annotations["authorization.k8s.io/decision"] == "forbid" {
			refused = append(refused, fmt.Sprintf("%s %s/%s", c, e.ObjectRef.Namespace, e.ObjectRef.Name))
		}
		if r := e.ResponseStatus; r != nil && slices.ContainsFunc(policies, func(p string) bool { return strings.Contains(r.Message, p) }) {
			refused = append(refused, fmt.Sprintf("%s %s/%s: %s", c, e.ObjectRef.Namespace, e.ObjectRef.Name, r.Message))
		}
		if node := e.User.Extra[nodeNameExtra]; strings.HasSuffix(e.User.Username, ":dirpv-node") && !slices.Equal(node, []string{suite.Cluster.NodeName}) {
			unbound = append(unbound, fmt.Sprintf("%s %s/%s: %s %v", c, e.ObjectRef.Namespace, e.ObjectRef.Name, nodeNameExtra, node))
		}
	}
	must(t, s.Err())
	if len(used) == 0 {
		t.Fatal("the audit log holds no request of dirpv's ServiceAccounts")
	}
	for _, r := range refused {
		t.Errorf("refused a call dirpv made: %s", r)
	}
	for i, u := range unbound {
		if i == 5 {
			t.Errorf("... and %d more calls of dirpv node without its node", len(unbound)-i)
			break
		}
		t.Errorf("dirpv node called without its node in the token: %s", u)
	}

	granted := grantedCalls(t)
	var lines []string
	for c, n := range used {
		lines = append(lines, fmt.Sprintf("%s x%d", c, n))
		if !granted[c] {
			t.Errorf("call %s is not granted by any rule in deploy/ (made %d times)", c, n)
		}
	}
	sort.Strings(lines)
	t.Logf("calls made:\n  %s", strings.Join(lines, "\n  "))
	var unused []string
	for c := range granted {
		if used[c] == 0 {
			unused = append(unused, c.String())
		}
	}
	sort.Strings(unused)
	// Not an error: some grants serve paths this suite cannot reach here (NFS provisioning in
	// the controller, lost nodes). test/deploy pins the rules and says why each exists.
	t.Logf("granted but not used in this suite:\n  %s", strings.Join(unused, "\n  "))
}

// grantedCalls expands the installed Roles and ClusterRoles bound to dirpv's ServiceAccounts
// into (user, group, resource, verb) tuples.
func grantedCalls(t *testing.T) map[call]bool {
	t.Helper()
	roles := map[string][]rbacv1.PolicyRule{}
	type binding struct {
		role     string
		subjects []rbacv1.Subject
	}
	var bindings []binding
	for _, o := range inst.Objects {
		switch o.GetKind() {
		case "ClusterRole", "Role":
			var r rbacv1.ClusterRole
			must(t, runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &r))
			roles[o.GetKind()+"/"+o.GetName()] = r.Rules
		case "ClusterRoleBinding", "RoleBinding":
			var b rbacv1.RoleBinding
			must(t, runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &b))
			bindings = append(bindings, binding{b.RoleRef.Kind + "/" + b.RoleRef.Name, b.Subjects})
		}
	}
	granted := map[call]bool{}
	for _, b := range bindings {
		for _, subj := range b.subjects {
			user := "system:serviceaccount:" + subj.Namespace + ":" + subj.Name
			for _, rule := range roles[b.role] {
				for _, g := range rule.APIGroups {
					for _, res := range rule.Resources {
						for _, v := range rule.Verbs {
							granted[call{user, g, res, v}] = true
						}
					}
				}
			}
		}
	}
	return granted
}

// Runs last: go test runs a package's tests in file order, files by name, and this is the last
// file; every other test needs dirpv installed. Uninstalling leaves kubelet with no dirpv.io
// plugin registered.
func TestUninstallUnregistersFromKubelet(t *testing.T) {
	ctx := context.Background()
	must(t, inst.Uninstall(ctx))
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		n, err := suite.Client.StorageV1().CSINodes().Get(ctx, suite.Cluster.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return !slices.ContainsFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == "dirpv.io" }),
			fmt.Errorf("CSINode still lists %+v", n.Spec.Drivers)
	})
	must(t, err)
	if _, err := os.Stat(filepath.Join(suite.Cluster.PluginRegistryDir, "dirpv.io-reg.sock")); !os.IsNotExist(err) {
		t.Errorf("registration socket still there: %v", err)
	}
}
