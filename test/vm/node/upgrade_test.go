package node_test

import (
	"context"
	"path"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/node"
)

// TestNFSUpgradeFromRelease: NFS claims through an upgrade, which the e2e tier's upgrade test
// (test/e2e/install, TestUpgradeFromRelease) cannot make: its host kernel has no NFS client.
// The suite's dirpv is uninstalled and framework.OldRelease installed on the guest node from
// its own deploy/ (the e2e-local overlay) with its own image; it makes NFS volumes on the
// guest's kernel NFS server, a pod appending to one of them. This checkout's overlay is then
// applied over it, as docs/operations.md ("Upgrading") says, which replaces every dirpv pod.
// Through that: the writer keeps running and appending to the same file on the server with no
// failed write; a new pod mounts the old volume as server:/<volume dir> with the class's
// mountOptions; deleting old claims deletes and archives their directories on the server's
// exported directory as their classes say. Runs last (file order): it replaces the suite's
// install, and leaves this checkout's installed again.
func TestNFSUpgradeFromRelease(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	cs := suite.Client
	start := time.Now()
	rel, err := framework.PrepareRelease(ctx, framework.OldRelease, t.TempDir(), t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	// The import (tens of seconds under emulation) goes on while the suite's dirpv goes.
	imported := make(chan error, 1)
	go func() { imported <- guestNode.ImportImage(ctx, rel.ImageTar) }()
	ds, err := cs.AppsV1().DaemonSets("dirpv").Get(ctx, "dirpv-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	newImage := ds.Spec.Template.Spec.Containers[0].Image
	render := func(opts deploy.E2ELocalOptions) []*unstructured.Unstructured {
		t.Helper()
		objs, err := framework.RenderInstall(ctx, suite.Cluster, opts)
		if err != nil {
			t.Fatal(err)
		}
		return objs
	}
	// What setup installed, and the old release's overlay.
	newObjs := render(deploy.E2ELocalOptions{Image: newImage, NodeArgs: []string{"--quota-check-period=" + quotaCheckPeriod.String()}})
	oldObjs := render(deploy.E2ELocalOptions{Root: rel.DeployRoot, Image: rel.Image})

	// A user's cluster has the old version only. This checkout's install comes back at the end
	// whatever happens; the writer goes first (its shell ignores SIGTERM).
	current, err := framework.Installed(suite.Cluster.Kubeconfig, newObjs)
	if err != nil {
		t.Fatal(err)
	}
	var ns string
	t.Cleanup(func() {
		ctx := context.Background()
		if ns != "" {
			zero := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}
			if err := cs.CoreV1().Pods(ns).DeleteCollection(ctx, zero, metav1.ListOptions{}); err != nil {
				t.Errorf("delete the test's pods: %v", err)
			}
		}
		if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, newObjs, ""); err != nil {
			t.Errorf("reinstall this checkout: %v", err)
		} else if err := framework.WaitRolledOut(ctx, cs, "dirpv", newImage, installTimeout); err != nil {
			t.Errorf("reinstall this checkout: %v", err)
		}
	})
	err = current.Uninstall(ctx)
	if importErr := <-imported; importErr != nil {
		t.Fatal(importErr)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("image %s imported into the guest, the suite's dirpv uninstalled, in %s", rel.Image, time.Since(start).Round(time.Millisecond))
	installStart := time.Now()
	if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, oldObjs, ""); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForDriverRegistered(ctx, cs, guestNode.Name, installTimeout); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitRolledOut(ctx, cs, "dirpv", rel.Image, installTimeout); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s installed in %s (%s since the test's start)", rel.Image, time.Since(installStart).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))

	// Volumes made, and mounted, by the old version: a ReadWriteMany claim that a pod appends
	// to, and claims of classes that delete and archive, which a pod writes once.
	ns = newNamespace(ctx, t)
	// Options a mount without them would not show (the default is 4.2, relatime), so that the
	// new pod's mount shows that this version takes them from the old PV.
	options := []string{"nfsvers=4.1", "hard", "noatime"}
	class := suite.CreateClass(t, "nfs-upgrade-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": "/"},
		framework.Immediate, framework.MountOptions(options...))
	suite.CreateClaim(t, ns, "shared", class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	policies := []string{"delete", "archive"}
	for _, p := range policies {
		class := suite.CreateClass(t, "nfs-upgrade-"+p+"-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": "/", "onDelete": p},
			framework.Immediate, framework.MountOptions("nfsvers=4.2"))
		suite.CreateClaim(t, ns, p, class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	}
	createPod(ctx, t, ns, "writer", "shared", framework.WriterScript)
	createPods(ctx, t, reclaimWriterPod(ns, "seeder", policies))
	if _, err := framework.WaitForPodPhase(ctx, cs, ns, "writer", corev1.PodRunning, podTimeout); err != nil {
		t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "Pod", "writer"))
	}
	podOutput(ctx, t, ns, "seeder", podTimeout)
	pvs := map[string]*corev1.PersistentVolume{}
	for _, claim := range append([]string{"shared"}, policies...) {
		if pvs[claim], err = framework.WaitForBoundPV(ctx, cs, ns, claim, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	volDir := pvs["shared"].Spec.CSI.VolumeAttributes["path"]
	readLog := func(ctx context.Context) ([]byte, error) {
		out, err := guestNode.Exec(ctx, time.Minute, "cat", path.Join(node.NFSExportDir, volDir, "log"))
		return []byte(out), err
	}
	lines, err := framework.CheckCounting(ctx, readLog, 0, podTimeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("volumes made by %s, the writer's log on the server has %d lines, %s since the test's start", rel.Image, lines, time.Since(start).Round(time.Millisecond))
	oldPods := dirpvPods(ctx, t)

	// The upgrade, as docs/operations.md says: this version's overlay applied over the old one.
	upgradeStart := time.Now()
	if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, newObjs, ""); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitRolledOut(ctx, cs, "dirpv", newImage, installTimeout); err != nil {
		t.Fatal(err)
	}
	t.Logf("upgraded to %s in %s", newImage, time.Since(upgradeStart).Round(time.Millisecond))
	newPods := dirpvPods(ctx, t)
	for name := range oldPods {
		if _, ok := newPods[name]; ok {
			t.Errorf("dirpv pod %s of the old version still runs: %v", name, newPods)
		}
	}
	// The writer went on through the node plugin's restart, appending to the same file on the
	// server, with no failed write.
	if lines, err = framework.CheckWriting(ctx, cs, ns, "writer", readLog, lines, podTimeout); err != nil {
		t.Fatal(err)
	}
	t.Logf("the writer runs on after the upgrade: %d lines", lines)

	// A new pod mounts the old volume, mounted by this version's node plugin.
	createPod(ctx, t, ns, "reader", "shared", "cat /data/seed && grep ' /data ' /proc/self/mounts")
	log := podOutput(ctx, t, ns, "reader", podTimeout)
	t.Logf("new pod on the old claim Succeeded %s after the upgrade; log:\n%s", time.Since(upgradeStart).Round(time.Millisecond), log)
	source := node.NFSAddr + ":/" + volDir
	if l := strings.Split(strings.TrimSpace(log), "\n"); len(l) != 2 || l[0] != "seed" {
		t.Errorf("new pod on the old claim: log %q, want the writer's seed, then its mount", log)
	} else if m := strings.Fields(l[1]); len(m) < 4 || m[0] != source || m[1] != "/data" || m[2] != "nfs4" {
		t.Errorf("new pod on the old claim: mount %q, want %s on /data of type nfs4", l[1], source)
	} else {
		for _, want := range []string{"rw", "vers=4.1", "hard", "noatime"} {
			if !slices.Contains(strings.Split(m[3], ","), want) {
				t.Errorf("new pod on the old claim: mount options %s: no %s (class mountOptions %v)", m[3], want, options)
			}
		}
	}

	// Old claims are deleted and archived on the server by this version, as their classes say.
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "seeder", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForPodDeleted(ctx, cs, ns, "seeder", podTimeout); err != nil {
		t.Fatal(err)
	}
	for _, p := range policies {
		if err := cs.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, p, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range policies {
		if err := framework.WaitForPVDeleted(ctx, cs, pvs[p].Name, 2*time.Minute); err != nil {
			t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, "", "PersistentVolume", pvs[p].Name))
		}
	}
	delete(pvs, "shared")
	checkReclaimedOnServer(ctx, t, pvs)
	if _, err = framework.CheckWriting(ctx, cs, ns, "writer", readLog, lines, podTimeout); err != nil {
		t.Error(err)
	}
	t.Logf("NFS upgrade test took %s", time.Since(start).Round(time.Millisecond))
}
