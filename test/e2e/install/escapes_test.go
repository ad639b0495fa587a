package install

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// quotaCheckPeriod is the installed node plugin's --quota-check-period (TestMain).
const quotaCheckPeriod = 5 * time.Second

// A tenant pod of a 16Mi claim on the btrfs base (UID 1000, no capabilities, no privilege
// escalation) creates a subvolume inside its volume, as `btrfs subvolume create` does, and
// writes 32Mi into it: the kernel allows both, and the volume's qgroup does not count a
// nested subvolume, so the claim's size does not hold against it. What dirpv does about it
// is tell: the node's quota check puts a Warning QuotaEscape event on the claim naming the
// subvolume. Deleting the claim removes the volume, nested subvolume and all.
func TestPodNestedSubvolumeIsReported(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	suite.CreateClass(t, "install-subvolume", map[string]string{"backend": "local", "basePath": btrfsBase,
		"capacityEnforcement": "required", "uid": "1000", "gid": "1000"})
	suite.CreateClaim(t, ns, "data", "install-subvolume", framework.Request("16Mi"))

	tools := filepath.Join(suite.Work.Dir, "tenant-tool")
	must(t, os.MkdirAll(tools, 0o755))
	must(t, framework.BuildTenantTool(ctx, tools))
	pod := suite.BusyboxPod(ns, "tenant", "data", `T=/tools/tenant
mkdir /data/d; echo "subvolume: $($T subvolume /data/d/sub)"
dd if=/dev/zero of=/data/d/sub/big bs=1M count=32 conv=fsync 2>&1; echo "dd exit $?"`, false)
	pod.Spec.Containers[0].SecurityContext = &v1.SecurityContext{
		RunAsUser: ptr.To[int64](1000), RunAsGroup: ptr.To[int64](1000), RunAsNonRoot: ptr.To(true),
		AllowPrivilegeEscalation: ptr.To(false),
		Capabilities:             &v1.Capabilities{Drop: []v1.Capability{"ALL"}},
	}
	suite.CreatePod(t, framework.WithTenantTool(pod, tools))
	logs := podDone(t, ns, "tenant")
	t.Logf("tenant pod:\n%s", logs)
	if !strings.Contains(logs, "subvolume: ok") {
		t.Fatalf("the tenant pod could not create a subvolume in its volume: %q; the kernel allowed it when this test was written", logs)
	}
	dir := volumeDir(t, ns, "data")
	st, err := os.Stat(filepath.Join(dir, "d/sub/big"))
	if !strings.Contains(logs, "dd exit 0") || err != nil || st.Size() != 32<<20 {
		t.Errorf("writing 32Mi into a nested subvolume of a 16Mi claim: pod printed %q, file %v (%v); want all 32Mi written (the escape this test measures)", logs, st, err)
	}

	ev, err := framework.WaitForEvent(ctx, suite.Client, ns, "PersistentVolumeClaim", "data", provisioner.ReasonQuotaEscape,
		`holds 1 nested btrfs subvolume(s), e.g. "d/sub"`, 10*quotaCheckPeriod+timeout)
	must(t, err)
	if ev.Type != v1.EventTypeWarning {
		t.Errorf("event %s: %s, want a Warning", ev.Type, ev.Message)
	}
	t.Logf("event: %s", ev.Message)

	deletePodAndClaim(t, ns, "tenant", "data")
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("volume %s with its nested subvolume after the claim's delete: %v, want it gone", dir, err)
	}
}

// A hostile pod fills its volume with symlinks to the host: its /etc and /, the base
// directory, another claim's directory, a directory beside the base, upwards. dirpv then
// answers NodeGetVolumeStats about them, deletes the volume (onDelete delete) and archives one
// (onDelete archive); none of that may touch anything outside the volume. The pod cannot see
// the host, but it can write any absolute path into a symlink, and the node plugin runs as
// root with the base's host directory mounted at the same path: the tree around the base
// (the other claim's data and the directory beside the base) is hashed before and after. The
// attackers' pods each have exactly one mount at their volume's target, and none once they
// are gone.
func TestSymlinksToHostSurviveDeleteArchiveAndStats(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	// Per run: a second run (-count=2) reusing the first run's base path and classes, both
	// removed at its end, waited for ever on its victim pod (Pending, no event).
	top := filepath.Join(basePath, "install-symlink-"+ns)
	deleteClass, archiveClass := "install-symlink-delete-"+ns, "install-symlink-archive-"+ns
	base := filepath.Join(top, "base")
	decoy := filepath.Join(top, "decoy")
	t.Cleanup(func() { os.RemoveAll(top) })
	for f, content := range map[string]string{"decoy/data": "beside the base", "decoy/sub/deeper": "deeper"} {
		p := filepath.Join(top, f)
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must(t, os.WriteFile(p, []byte(content), 0o640))
	}
	suite.CreateClass(t, deleteClass, map[string]string{"backend": "local", "basePath": base, "onDelete": "delete"})
	suite.CreateClass(t, archiveClass, map[string]string{"backend": "local", "basePath": base, "onDelete": "archive"})

	// The victim: another tenant's claim with data.
	suite.CreateClaim(t, ns, "victim", deleteClass)
	suite.CreatePod(t, suite.BusyboxPod(ns, "victim", "victim", "echo victim-data > /data/data && mkdir /data/sub && echo more > /data/sub/f", false))
	podDone(t, ns, "victim")
	victimDir := volumeDir(t, ns, "victim")
	victimPV, err := framework.WaitForBoundPV(ctx, suite.Client, ns, "victim", timeout)
	must(t, err)

	links := map[string]string{
		"host-etc":               "/etc",
		"host-root":              "/",
		"base":                   base,
		"victim":                 victimDir,
		"victim-file":            filepath.Join(victimDir, "data"),
		"decoy":                  decoy,
		"up":                     "../..",
		"nested/deeper/host-etc": "/etc",
		"nested/deeper/victim":   victimDir,
		"loop1":                  "loop2",
		"loop2":                  "loop1",
	}
	var script strings.Builder
	script.WriteString("set -e\nmkdir -p /data/nested/deeper\n")
	for name, target := range links {
		fmt.Fprintf(&script, "ln -s '%s' '/data/%s'\n", target, name)
	}
	script.WriteString("mkfifo /data/fifo\necho links-done\nsleep 3600\n")

	type attacker struct {
		claim, class string
		pv           *v1.PersistentVolume
		dir, target  string
	}
	attackers := []*attacker{{claim: "attacker-delete", class: deleteClass}, {claim: "attacker-archive", class: archiveClass}}
	for _, a := range attackers {
		suite.CreateClaim(t, ns, a.claim, a.class)
		suite.CreatePod(t, suite.BusyboxPod(ns, a.claim, a.claim, script.String(), false))
	}
	for _, a := range attackers {
		pod, err := framework.WaitForPodPhase(ctx, suite.Client, ns, a.claim, v1.PodRunning, timeout)
		if err != nil {
			t.Fatalf("%v\n%s", err, framework.EventsOf(ctx, suite.Client, ns, "Pod", a.claim))
		}
		a.pv, err = framework.WaitForBoundPV(ctx, suite.Client, ns, a.claim, timeout)
		must(t, err)
		a.dir = filepath.Join(base, a.pv.Spec.CSI.VolumeAttributes["path"])
		// Where kubelet asks the plugin to publish the pod's volume.
		a.target = filepath.Join(suite.Cluster.KubeletRootDir, "pods", string(pod.UID), "volumes", "kubernetes.io~csi", a.pv.Name, "mount")
		if m, err := framework.MountsUnder(a.target); err != nil || len(m) != 1 {
			t.Errorf("mounts at %s's volume target %s: %v %v, want exactly one", a.claim, a.target, m, err)
		}
		err = framework.Poll(ctx, timeout, func(context.Context) (bool, error) {
			_, err := os.Lstat(filepath.Join(a.dir, "fifo"))
			return err == nil, err
		})
		if err != nil {
			t.Fatalf("%s never finished its symlinks: %v", a.claim, err)
		}
		for name, target := range links {
			if got, err := os.Readlink(filepath.Join(a.dir, name)); err != nil || got != target {
				t.Fatalf("%s: symlink %s = %q %v, want -> %s", a.claim, name, got, err, target)
			}
		}
	}
	// Everything the symlinks reach in the plugin's view, minus the attackers' own volumes
	// (which are meant to go).
	attackerPaths := map[string]bool{}
	for _, a := range attackers {
		attackerPaths[a.pv.Spec.CSI.VolumeAttributes["path"]] = true
	}
	skipAttackers := func(rel string) bool {
		first, _, _ := strings.Cut(strings.TrimPrefix(rel, "base/"), "/")
		if !strings.HasPrefix(rel, "base/") {
			return false
		}
		for p := range attackerPaths {
			if first == p || strings.HasPrefix(first, "archived-"+p+"-") {
				return true
			}
		}
		return false
	}
	before, err := framework.SnapshotTree(top, skipAttackers)
	must(t, err)
	if _, ok := before["base/"+victimPV.Spec.CSI.VolumeAttributes["path"]+"/data"]; !ok {
		t.Fatalf("victim's data missing from the snapshot: %v", before)
	}
	check := func(when string) {
		t.Helper()
		after, err := framework.SnapshotTree(top, skipAttackers)
		must(t, err)
		if d := framework.DiffSnapshots(before, after); len(d) > 0 {
			t.Errorf("%s changed %s (base, victim, decoy):\n%s", when, top, strings.Join(d, "\n"))
		}
	}

	// NodeGetVolumeStats, through the node plugin's own CSI socket as kubelet calls it.
	sock := filepath.Join(suite.Cluster.KubeletRootDir, "plugins", "dirpv.io", "csi.sock")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	for _, a := range attackers {
		id := a.pv.Spec.CSI.VolumeHandle
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		resp, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: a.target})
		if err != nil || len(resp.GetUsage()) != 2 {
			t.Errorf("%s: NodeGetVolumeStats at its target: %v %v", a.claim, resp, err)
		}
		// Paths through the pod's symlinks, or elsewhere on the host, are not published volumes.
		for _, p := range []string{
			filepath.Join(a.target, "host-etc"), filepath.Join(a.target, "base"), filepath.Join(a.target, "victim"),
			filepath.Join(a.target, "up"), filepath.Join(a.target, "loop1"), filepath.Join(a.target, "fifo"),
			a.target + "/../../..", "/etc", base, victimDir, a.dir,
		} {
			_, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: p})
			if status.Code(err) != codes.NotFound {
				t.Errorf("%s: NodeGetVolumeStats at %s: %v, want NotFound", a.claim, p, err)
			}
		}
		// A mount point the plugin does not know as another volume's is answered (statfs only,
		// from a caller that already has the root-only socket): documented in SECURITY.md.
		if _, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: "/"}); err != nil && status.Code(err) != codes.NotFound {
			t.Errorf("%s: NodeGetVolumeStats at /: %v, want an answer or NotFound", a.claim, err)
		}
		// Another volume's ID at this target.
		_, err = node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: victimPV.Spec.CSI.VolumeHandle, VolumePath: a.target})
		if status.Code(err) != codes.NotFound {
			t.Errorf("%s: NodeGetVolumeStats of the victim's ID at the attacker's target: %v, want NotFound", a.claim, err)
		}
		cancel()
	}
	check("NodeGetVolumeStats")

	// Delete and archive the attackers' volumes.
	for _, a := range attackers {
		deletePod(t, ns, a.claim)
		// kubelet unpublishes once the pod object is gone.
		must(t, framework.WaitForNoMountsUnder(ctx, filepath.Dir(a.target), timeout))
		if _, err := os.Stat(a.target); !os.IsNotExist(err) {
			t.Errorf("target %s still exists after unpublish: %v", a.target, err)
		}
		deletePodAndClaim(t, ns, "", a.claim)
	}
	if _, err := os.Lstat(attackers[0].dir); !os.IsNotExist(err) {
		t.Errorf("onDelete delete left %s: %v", attackers[0].dir, err)
	}
	if _, err := os.Lstat(attackers[1].dir); !os.IsNotExist(err) {
		t.Errorf("onDelete archive left %s in place: %v", attackers[1].dir, err)
	}
	archived, _ := filepath.Glob(filepath.Join(base, "archived-"+filepath.Base(attackers[1].dir)+"-*"))
	if len(archived) != 1 {
		t.Fatalf("archives of %s: %v, want one", attackers[1].dir, archived)
	}
	for name, target := range links {
		if got, err := os.Readlink(filepath.Join(archived[0], name)); err != nil || got != target {
			t.Errorf("archived symlink %s = %q %v, want it kept as a link to %s", name, got, err, target)
		}
	}
	check("delete and archive")
	if b, err := os.ReadFile(filepath.Join(victimDir, "data")); err != nil || string(b) != "victim-data\n" {
		t.Errorf("victim's data: %q %v", b, err)
	}
}
