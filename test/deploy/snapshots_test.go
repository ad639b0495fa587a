package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	rbacv1 "k8s.io/api/rbac/v1"
)

// snapshotObjects are what the snapshots option adds to an installation, no more.
var snapshotObjects = []string{
	"ClusterRole /dirpv-snapshot-controller",
	"ClusterRoleBinding /dirpv-snapshot-controller",
	"CustomResourceDefinition /volumesnapshotclasses.snapshot.storage.k8s.io",
	"CustomResourceDefinition /volumesnapshotcontents.snapshot.storage.k8s.io",
	"CustomResourceDefinition /volumesnapshots.snapshot.storage.k8s.io",
	"Deployment dirpv/dirpv-snapshot-controller",
	"Role dirpv/dirpv-snapshot-controller-leader-election",
	"RoleBinding dirpv/dirpv-snapshot-controller-leader-election",
	"ServiceAccount dirpv/dirpv-snapshot-controller",
	"VolumeSnapshotClass /dirpv-local",
	"VolumeSnapshotClass /dirpv-nfs",
}

// The common snapshot controller's rules: upstream's without group snapshots, plus nodes.
var snapshotControllerRules = map[string][]rbacv1.PolicyRule{
	"ClusterRole dirpv-snapshot-controller": {
		{APIGroups: []string{""}, Resources: []string{"persistentvolumes"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"persistentvolumeclaims"}, Verbs: []string{"get", "list", "watch", "update"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotclasses"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotcontents"}, Verbs: []string{"create", "get", "list", "watch", "update", "delete", "patch"}},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshotcontents/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshots"}, Verbs: []string{"get", "list", "watch", "update", "patch"}},
		{APIGroups: []string{"snapshot.storage.k8s.io"}, Resources: []string{"volumesnapshots/status"}, Verbs: []string{"update", "patch"}},
	},
	"Role dirpv-snapshot-controller-leader-election": {
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"create"}},
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, ResourceNames: []string{"dirpv-snapshot-controller"}, Verbs: []string{"get", "update"}},
	},
}

// TestSnapshotsOption: the common snapshot controller the snapshots option adds (what else it
// adds and that the chart's snapshots.enabled renders the same: TestHelmMatchesKustomize) has
// exactly its rules, valid objects and pinned images.
func TestSnapshotsOption(t *testing.T) {
	kustomize, _ := tools(t)
	withComponent := kustomizeObjs(t, kustomize, "test/deploy/testdata/snapshots")
	for role, want := range snapshotControllerRules {
		kind, name, _ := strings.Cut(role, " ")
		var g, w []string
		for _, r := range rulesOf(t, withComponent, kind, "dirpv", name) {
			g = append(g, joinRule(r))
		}
		for _, r := range want {
			w = append(w, joinRule(r))
		}
		if !reflect.DeepEqual(g, w) {
			t.Errorf("%s rules:\n got  %v\n want %v", role, g, w)
		}
	}
	for _, k := range []string{"Deployment dirpv/dirpv-snapshot-controller", "ServiceAccount dirpv/dirpv-snapshot-controller"} {
		typed(t, withComponent[k])
	}
	for _, img := range images(withComponent["Deployment dirpv/dirpv-snapshot-controller"].Object) {
		if err := pinnedImage(img); err != nil {
			t.Error(err)
		}
	}
}

// TestSnapshotCRDsAreUpstream: both vendored copies of the snapshot CRDs are byte for byte the
// files of the external-snapshotter client module that go.mod requires, so that the CRDs
// installed are the API the in-process controllers were built against.
func TestSnapshotCRDsAreUpstream(t *testing.T) {
	out, err := exec.CommandContext(t.Context(), "go", "list", "-m", "-f", "{{.Dir}}", "github.com/kubernetes-csi/external-snapshotter/client/v8").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	upstream := filepath.Join(strings.TrimSpace(string(out)), "config", "crd")
	root, err := RepoDir()
	must(t, err)
	for _, dir := range []string{"deploy/components/snapshots/crds", "deploy/helm/dirpv/charts/snapshot-crds/crds"} {
		files, err := filepath.Glob(filepath.Join(root, dir, "*.yaml"))
		if err != nil || len(files) != 3 {
			t.Fatalf("%s: %d CRD files (%v), want 3", dir, len(files), err)
		}
		for _, f := range files {
			mine, err := os.ReadFile(f)
			must(t, err)
			theirs, err := os.ReadFile(filepath.Join(upstream, filepath.Base(f)))
			if err != nil {
				t.Fatalf("%s has no upstream counterpart: %v", f, err)
			}
			if !bytes.Equal(mine, theirs) {
				t.Errorf("%s differs from %s", f, filepath.Join(upstream, filepath.Base(f)))
			}
		}
	}
}
