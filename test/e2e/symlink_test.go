package e2e

// A hostile pod fills its volume with symlinks to the host: its /etc, the base directory,
// another claim's directory, a directory beside the base, upwards. dirpv then deletes the
// volume (onDelete delete), archives one (onDelete archive) and answers NodeGetVolumeStats
// about them; none of that may touch anything outside the volume. The pod cannot see the host,
// but it can write any absolute host path into a symlink, and dirpv runs on the host as root.

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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

func TestSymlinksToHostSurviveDeleteArchiveAndStats(t *testing.T) {
	ns := suite.NewNamespace(t)
	top := filepath.Join(suite.Work.BaseRoot, "symlink")
	base := filepath.Join(top, "base")
	decoy := filepath.Join(top, "decoy")
	for f, content := range map[string]string{"decoy/data": "beside the base", "decoy/sub/deeper": "deeper"} {
		p := filepath.Join(top, f)
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must(t, os.WriteFile(p, []byte(content), 0o640))
	}
	suite.CreateClass(t, "e2e-symlink-delete", map[string]string{"backend": "local", "basePath": base, "onDelete": "delete"})
	suite.CreateClass(t, "e2e-symlink-archive", map[string]string{"backend": "local", "basePath": base, "onDelete": "archive"})

	// The victim: another tenant's claim with data.
	suite.CreateClaim(t, ns, "victim", "e2e-symlink-delete")
	suite.CreatePod(t, suite.BusyboxPod(ns, "victim", "victim", "echo victim-data > /data/data && mkdir /data/sub && echo more > /data/sub/f", false))
	waitPodPhase(t, ns, "victim", v1.PodSucceeded)
	victimPV := boundPV(t, ns, "victim")
	victimDir := filepath.Join(base, victimPV.Spec.CSI.VolumeAttributes["path"])

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
		pod          *v1.Pod
		pv           *v1.PersistentVolume
		dir          string
	}
	attackers := []*attacker{{claim: "attacker-delete", class: "e2e-symlink-delete"}, {claim: "attacker-archive", class: "e2e-symlink-archive"}}
	for _, a := range attackers {
		suite.CreateClaim(t, ns, a.claim, a.class)
		suite.CreatePod(t, suite.BusyboxPod(ns, a.claim, a.claim, script.String(), false))
	}
	for _, a := range attackers {
		a.pod = waitPodPhase(t, ns, a.claim, v1.PodRunning)
		a.pv = boundPV(t, ns, a.claim)
		a.dir = filepath.Join(base, a.pv.Spec.CSI.VolumeAttributes["path"])
		err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
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
	// Everything the symlinks reach, minus the attackers' own volumes (which are meant to go).
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
	etcBefore := snapshotHostTree(t, "/etc", nil)
	topBefore := snapshotHostTree(t, top, skipAttackers)
	if _, ok := topBefore["base/"+victimPV.Spec.CSI.VolumeAttributes["path"]+"/data"]; !ok {
		t.Fatalf("victim's data missing from the snapshot: %v", topBefore)
	}
	check := func(when string) {
		t.Helper()
		for what, d := range map[string][]string{
			"/etc":                         framework.DiffSnapshots(etcBefore, snapshotHostTree(t, "/etc", nil)),
			top + " (base, victim, decoy)": framework.DiffSnapshots(topBefore, snapshotHostTree(t, top, skipAttackers)),
		} {
			if len(d) > 0 {
				t.Errorf("%s changed %s:\n%s", when, what, strings.Join(d, "\n"))
			}
		}
	}

	// NodeGetVolumeStats, through the node plugin's own CSI socket as kubelet calls it.
	sock := filepath.Join(suite.Cluster.KubeletRootDir, "plugins", "dirpv.io", "csi.sock")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	for _, a := range attackers {
		target := volumeTarget(a.pod, a.pv.Name)
		id := a.pv.Spec.CSI.VolumeHandle
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		resp, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
		if err != nil || len(resp.GetUsage()) != 2 {
			t.Errorf("%s: NodeGetVolumeStats at its target: %v %v", a.claim, resp, err)
		}
		// Paths through the pod's symlinks, or elsewhere on the host, are not published volumes.
		for _, p := range []string{
			filepath.Join(target, "host-etc"), filepath.Join(target, "base"), filepath.Join(target, "victim"),
			filepath.Join(target, "up"), filepath.Join(target, "loop1"), filepath.Join(target, "fifo"),
			target + "/../../..", "/etc", base, victimDir, a.dir,
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
		_, err = node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: victimPV.Spec.CSI.VolumeHandle, VolumePath: target})
		if status.Code(err) != codes.NotFound {
			t.Errorf("%s: NodeGetVolumeStats of the victim's ID at the attacker's target: %v, want NotFound", a.claim, err)
		}
		cancel()
	}
	check("NodeGetVolumeStats")

	// Delete and archive the attackers' volumes.
	for _, a := range attackers {
		deletePod(t, ns, a.claim)
		waitNoMountsUnder(t, filepath.Dir(volumeTarget(a.pod, a.pv.Name)))
		must(t, suite.Client.CoreV1().PersistentVolumeClaims(ns).Delete(context.Background(), a.claim, metav1.DeleteOptions{}))
	}
	for _, a := range attackers {
		if err := framework.WaitForPVDeleted(context.Background(), suite.Client, a.pv.Name, timeout); err != nil {
			t.Fatalf("%s: %v\n--- node plugin log tail:\n%s", a.claim, err, nodeProc.Tail(3000))
		}
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

// snapshotHostTree snapshots root with framework.SnapshotTree, failing the test on error.
func snapshotHostTree(t *testing.T, root string, skip func(rel string) bool) map[string]string {
	t.Helper()
	s, err := framework.SnapshotTree(root, skip)
	must(t, err)
	return s
}
