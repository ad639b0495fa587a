package deploy

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
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
