package install

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/framework"
)

// oldRelease is what users ran before this version: the upgrade test installs it, makes
// volumes with it, and upgrades to this checkout (docs/operations.md, "Upgrading").
const oldRelease = "61921de"

// writerScript writes a seed file, then appends a counter to /data/log until a write fails:
// the pod then ends (Failed) saying so, which an I/O error through a mount whose node plugin
// went away would cause.
const writerScript = `echo seed > /data/seed; i=0; while echo $i >> /data/log; do i=$((i+1)); sleep 0.05; done; echo "write $i failed"; exit 1`

// An install of oldRelease, with volumes of every kind and pods writing to two of them, is
// upgraded in place to this checkout as docs/operations.md says (the new overlay applied over
// the old), then downgraded again. Runs after the other tests of the suite (file order): it
// replaces the suite's install by oldRelease's and leaves this checkout's installed again.
//
// Through the upgrade: the writing pods keep running with no failed write, appending to the
// same files the host sees; new pods mount the old volumes; an old claim grows past its old
// size; a claim is restored from a VolumeSnapshot the old version made; old claims are
// deleted, retained and archived as their classes say; the node's CSIStorageCapacity objects
// and the dirpv.io/node labels are there again; no directory is left without a PV; and the
// Warning events of the upgrade are listed and bounded.
//
// Downgrade (oldRelease's overlay applied over this one): the writing pods keep writing, and
// the old version mounts, and deletes, a volume this version made. What a user must know, in
// docs/operations.md ("Downgrading") and checked or shown here: `kubectl apply` removes
// nothing, so the node-write admission policy this version added stays (and still admits the
// old node plugin's writes, which the deletion shows); and oldRelease's host-network
// Deployments lack the one-at-a-time rollout, so on this one-node cluster the downgrade keeps
// it (withoutSurge), as the docs tell users to, else it would wait for ever on a Pending pod.
func TestUpgradeFromRelease(t *testing.T) {
	ctx := context.Background()
	c := suite.Client
	start := time.Now()
	rel, err := framework.PrepareRelease(ctx, oldRelease, t.TempDir(), t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	if err := suite.Cluster.ImportImage(ctx, rel.ImageTar); err != nil {
		t.Fatal(err)
	}
	ds, err := c.AppsV1().DaemonSets("dirpv").Get(ctx, "dirpv-node", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	newImage := ds.Spec.Template.Spec.Containers[0].Image
	newObjs, err := framework.RenderInstall(ctx, suite.Cluster, deploy.E2ELocalOptions{Image: newImage, NodeArgs: []string{"--quota-check-period=" + quotaCheckPeriod.String()}})
	if err != nil {
		t.Fatal(err)
	}
	oldObjs, err := framework.RenderInstall(ctx, suite.Cluster, deploy.E2ELocalOptions{Root: rel.DeployRoot, Image: rel.Image})
	if err != nil {
		t.Fatal(err)
	}
	apply := func(objs []*unstructured.Unstructured, image string) {
		t.Helper()
		if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, objs, ""); err != nil {
			t.Fatal(err)
		}
		if err := framework.WaitRolledOut(ctx, c, "dirpv", image, timeout); err != nil {
			t.Fatal(err)
		}
	}

	// A user's cluster has the old version only: this checkout's install goes first, and
	// comes back at the end whatever happens (cleanups run last first: after the namespace).
	if err := inst.Uninstall(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, newObjs, ""); err != nil {
			t.Errorf("reinstall this checkout: %v", err)
		} else if err := framework.WaitRolledOut(ctx, c, "dirpv", newImage, timeout); err != nil {
			t.Errorf("reinstall this checkout: %v", err)
		}
	})
	if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, oldObjs, ""); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForDriverRegistered(ctx, c, suite.Cluster.NodeName, timeout); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitRolledOut(ctx, c, "dirpv", rel.Image, timeout); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s installed in %s", rel.Image, time.Since(start).Round(time.Millisecond))

	// Volumes made by the old version.
	ns := suite.NewNamespace(t)
	suite.CreateClass(t, "upgrade-btrfs", map[string]string{"backend": "local", "basePath": btrfsBase, "capacityEnforcement": "required"},
		framework.AllowVolumeExpansion)
	suite.CreateClass(t, "upgrade-retain", map[string]string{"backend": "local", "basePath": basePath, "onDelete": "retain"})
	suite.CreateClass(t, "upgrade-archive", map[string]string{"backend": "local", "basePath": basePath, "onDelete": "archive"})
	suite.CreateClaim(t, ns, "host", "")
	suite.CreatePod(t, suite.BusyboxPod(ns, "host-writer", "host", writerScript, false))
	suite.CreateClaim(t, ns, "btrfs", "upgrade-btrfs", framework.Request("32Mi"))
	suite.CreatePod(t, suite.BusyboxPod(ns, "btrfs-writer", "btrfs", writerScript, false))
	for claim, class := range map[string]string{"gone": "", "kept": "upgrade-retain", "archived": "upgrade-archive"} {
		suite.CreateClaim(t, ns, claim, class)
		suite.CreatePod(t, suite.BusyboxPod(ns, claim, claim, "echo seed > /data/seed", false))
	}
	waitRunning(t, ns, "host-writer")
	waitRunning(t, ns, "btrfs-writer")
	hostDir, btrfsDir := volumeDir(t, ns, "host"), volumeDir(t, ns, "btrfs")
	waitFileHas(t, filepath.Join(hostDir, "seed"), "seed")
	waitFileHas(t, filepath.Join(btrfsDir, "seed"), "seed")
	for _, p := range []string{"gone", "kept", "archived"} {
		podDone(t, ns, p)
	}
	// Expanded while mounted, then cloned, by the old version.
	if err := framework.SetClaimSize(ctx, c, ns, "btrfs", "48Mi"); err != nil {
		t.Fatal(err)
	}
	if _, err := framework.WaitForClaimResized(ctx, c, ns, "btrfs", "48Mi", timeout); err != nil {
		t.Fatalf("%v\n%s", err, framework.EventsOf(ctx, c, ns, "PersistentVolumeClaim", "btrfs"))
	}
	suite.CreateClaim(t, ns, "clone", "upgrade-btrfs", framework.Request("48Mi"), func(pvc *v1.PersistentVolumeClaim) {
		pvc.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "btrfs"}
	})
	suite.CreatePod(t, suite.BusyboxPod(ns, "clone-reader", "clone", "cat /data/seed", false))
	if out := podDone(t, ns, "clone-reader"); out != "seed\n" {
		t.Errorf("the old version's clone holds %q, want seed", out)
	}
	snaps := snapClient(t)
	_, err = snaps.SnapshotV1().VolumeSnapshots(ns).Create(ctx, &snapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: "snap", Namespace: ns},
		Spec:       snapv1.VolumeSnapshotSpec{Source: snapv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To("host")}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitSnapshotReady(t, ns, "snap")

	capsBefore := nodeCapacities(t)
	labelsBefore := nodeLabels(t, ns)
	oldPods := dirpvPods(t)
	warningsBefore := warningCounts(t)
	hostLines := checkCounting(t, filepath.Join(hostDir, "log"), 0)
	btrfsLines := checkCounting(t, filepath.Join(btrfsDir, "log"), 0)

	// The upgrade, as docs/operations.md says: this version's overlay applied over the old one.
	upgradeStart := time.Now()
	apply(newObjs, newImage)
	t.Logf("upgraded to %s in %s", newImage, time.Since(upgradeStart).Round(time.Millisecond))
	for uid, name := range oldPods {
		if _, ok := dirpvPods(t)[uid]; ok {
			t.Errorf("dirpv pod %s (%s) of the old version still runs", name, uid)
		}
	}
	// The writers went on through the node plugin's restart, appending to the same files.
	hostLines = checkWriting(t, ns, "host-writer", filepath.Join(hostDir, "log"), hostLines)
	btrfsLines = checkWriting(t, ns, "btrfs-writer", filepath.Join(btrfsDir, "log"), btrfsLines)
	if got := nodeCapacities(t); !slices.Equal(slices.Sorted(maps.Keys(capsBefore)), slices.Sorted(maps.Keys(got))) {
		t.Errorf("CSIStorageCapacity after the upgrade %v, before %v", got, capsBefore)
	} else {
		t.Logf("CSIStorageCapacity before the upgrade %v, after %v", capsBefore, got)
	}
	if got := nodeLabels(t, ns); !maps.Equal(labelsBefore, got) {
		t.Errorf("dirpv.io/node labels after the upgrade %v, before %v", got, labelsBefore)
	}

	// New pods mount the old volumes; an old claim grows past its old size.
	suite.CreatePod(t, suite.BusyboxPod(ns, "host-reader", "host", "cat /data/seed", false))
	if out := podDone(t, ns, "host-reader"); out != "seed\n" {
		t.Errorf("a new pod on the old claim reads %q, want seed", out)
	}
	if err := framework.SetClaimSize(ctx, c, ns, "btrfs", "96Mi"); err != nil {
		t.Fatal(err)
	}
	if _, err := framework.WaitForClaimResized(ctx, c, ns, "btrfs", "96Mi", timeout); err != nil {
		t.Fatalf("%v\n%s", err, framework.EventsOf(ctx, c, ns, "PersistentVolumeClaim", "btrfs"))
	}
	suite.CreatePod(t, suite.BusyboxPod(ns, "filler", "btrfs", "dd if=/dev/zero of=/data/big bs=1M count=64 conv=fsync 2>&1 && echo fill-ok", false))
	if out := podDone(t, ns, "filler"); !strings.Contains(out, "fill-ok") {
		t.Errorf("64Mi into the old claim grown from 48Mi to 96Mi: %q", out)
	}
	// Restore from the old version's snapshot; a new claim.
	suite.CreateClaim(t, ns, "restored", "", func(pvc *v1.PersistentVolumeClaim) {
		pvc.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"}
	})
	suite.CreatePod(t, suite.BusyboxPod(ns, "restore-reader", "restored", "cat /data/seed", false))
	if out := podDone(t, ns, "restore-reader"); out != "seed\n" {
		t.Errorf("the claim restored from the old snapshot holds %q, want seed", out)
	}
	suite.CreateClaim(t, ns, "fresh", "upgrade-btrfs", framework.Request("32Mi"))
	suite.CreatePod(t, suite.BusyboxPod(ns, "fresh-writer", "fresh", "echo fresh > /data/seed", false))
	podDone(t, ns, "fresh-writer")
	checkNoOrphans(t, ns)

	// Old claims are deleted, retained and archived as their classes say.
	dirs := map[string]string{}
	for _, claim := range []string{"gone", "kept", "archived"} {
		dirs[claim] = volumeDir(t, ns, claim)
		t.Cleanup(func() { removeGlob(filepath.Join(basePath, "*"+filepath.Base(dirs[claim])+"*")) })
		deletePodAndClaim(t, ns, claim, claim)
	}
	if _, err := os.Stat(dirs["gone"]); !os.IsNotExist(err) {
		t.Errorf("onDelete delete left %s: %v", dirs["gone"], err)
	}
	waitFileHas(t, filepath.Join(dirs["kept"], "seed"), "seed")
	archived, _ := filepath.Glob(filepath.Join(basePath, "archived-"+filepath.Base(dirs["archived"])+"-*"))
	if _, err := os.Stat(dirs["archived"]); !os.IsNotExist(err) || len(archived) != 1 {
		t.Errorf("onDelete archive: %s is there (%v), archives %v", dirs["archived"], err, archived)
	} else {
		waitFileHas(t, filepath.Join(archived[0], "seed"), "seed")
	}
	checkWarnings(t, warningsBefore, "the upgrade")

	// The downgrade: the old overlay applied over this one, with the rollout strategy its
	// host-network Deployments lack (docs/operations.md, "Downgrading"): without it the
	// controller's new pod waits for ever for the old one's host port on this one-node
	// cluster, as the upgrade did before this version.
	warningsBefore = warningCounts(t)
	apply(withoutSurge(t, oldObjs), rel.Image)
	checkWriting(t, ns, "host-writer", filepath.Join(hostDir, "log"), hostLines)
	checkWriting(t, ns, "btrfs-writer", filepath.Join(btrfsDir, "log"), btrfsLines)
	// kubectl apply prunes nothing: what only this version installs stays.
	for _, o := range newObjs {
		if slices.ContainsFunc(oldObjs, func(old *unstructured.Unstructured) bool {
			return old.GetKind() == o.GetKind() && old.GetName() == o.GetName()
		}) {
			continue
		}
		t.Logf("left by the downgrade: %s %s", o.GetKind(), o.GetName())
	}
	// The old version mounts and deletes a volume this version made.
	freshDir := volumeDir(t, ns, "fresh")
	suite.CreatePod(t, suite.BusyboxPod(ns, "fresh-reader", "fresh", "cat /data/seed", false))
	if out := podDone(t, ns, "fresh-reader"); out != "fresh\n" {
		t.Errorf("after the downgrade a pod on a claim of this version reads %q, want fresh", out)
	}
	// A pod that ended still holds its claim (kube-controller-manager's PVC protection).
	if err := c.CoreV1().Pods(ns).Delete(ctx, "fresh-writer", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForPodDeleted(ctx, c, ns, "fresh-writer", timeout); err != nil {
		t.Fatal(err)
	}
	deletePodAndClaim(t, ns, "fresh-reader", "fresh")
	if _, err := os.Stat(freshDir); !os.IsNotExist(err) {
		t.Errorf("after the downgrade, deleting a claim of this version left %s: %v", freshDir, err)
	}
	checkNoOrphans(t, ns, filepath.Base(dirs["kept"]))
	checkWarnings(t, warningsBefore, "the downgrade")
	t.Logf("upgrade test took %s", time.Since(start).Round(time.Millisecond))
}

// withoutSurge returns objs with the host-network Deployments replaced one pod at a time, as
// this version's deploy/ has them: the patch docs/operations.md gives for a downgrade.
func withoutSurge(t *testing.T, objs []*unstructured.Unstructured) []*unstructured.Unstructured {
	t.Helper()
	out := make([]*unstructured.Unstructured, len(objs))
	for i, o := range objs {
		out[i] = o.DeepCopy()
		if hostNet, _, _ := unstructured.NestedBool(o.Object, "spec", "template", "spec", "hostNetwork"); o.GetKind() != "Deployment" || !hostNet {
			continue
		}
		err := unstructured.SetNestedField(out[i].Object, map[string]any{
			"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxSurge": int64(0), "maxUnavailable": int64(1)},
		}, "spec", "strategy")
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func snapClient(t *testing.T) snapclientset.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", suite.Cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	s, err := snapclientset.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// nodeCapacities returns the CSIStorageCapacity objects of the node: "class on node" ->
// object name, once there is at least one.
func nodeCapacities(t *testing.T) map[string]string {
	t.Helper()
	got := map[string]string{}
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		list, err := suite.Client.StorageV1().CSIStorageCapacities("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		clear(got)
		for _, c := range list.Items {
			var node string
			if c.NodeTopology != nil {
				node = c.NodeTopology.MatchLabels["kubernetes.io/hostname"]
			}
			got[c.StorageClassName+" on "+node] = c.Namespace + "/" + c.Name
		}
		return len(got) > 0, fmt.Errorf("no CSIStorageCapacity")
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// nodeLabels returns the dirpv.io/node label of every claim and PV of ns.
func nodeLabels(t *testing.T, ns string) map[string]string {
	t.Helper()
	ctx := context.Background()
	got := map[string]string{}
	claims, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range claims.Items {
		got["claim "+c.Name] = c.Labels["dirpv.io/node"]
		if c.Spec.VolumeName != "" {
			pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, c.Spec.VolumeName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			got["pv of "+c.Name] = pv.Labels["dirpv.io/node"]
		}
	}
	return got
}

// dirpvPods returns dirpv's pods by UID.
func dirpvPods(t *testing.T) map[types.UID]string {
	t.Helper()
	pods, err := suite.Client.CoreV1().Pods("dirpv").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[types.UID]string{}
	for _, p := range pods.Items {
		got[p.UID] = p.Name
	}
	return got
}

// warningCounts returns the count of every Warning event of the cluster by its UID.
func warningCounts(t *testing.T) map[types.UID]int32 {
	t.Helper()
	evs, err := suite.Client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{FieldSelector: "type=Warning"})
	if err != nil {
		t.Fatal(err)
	}
	got := map[types.UID]int32{}
	for _, e := range evs.Items {
		got[e.UID] = max(e.Count, 1)
	}
	return got
}

// An upgrade replaces dirpv's three pods: each new one may be refused a node once while its
// predecessor still holds its host port (FailedScheduling) and fail its first readiness probe
// before it serves (Unhealthy). An upgrade that makes dirpv or kubelet retry in a loop repeats
// an event or goes past the total.
const (
	maxUpgradeWarnings     = 8
	maxRepeatedWarningSeen = 3
)

// checkWarnings lists the Warning events since before (warningCounts) and fails on more than
// maxUpgradeWarnings, or one of them repeated more than maxRepeatedWarningSeen times. The test
// cluster runs no cluster DNS, which kubelet says for every pod (MissingClusterDNS): not counted.
func checkWarnings(t *testing.T, before map[types.UID]int32, what string) {
	t.Helper()
	evs, err := suite.Client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{FieldSelector: "type=Warning"})
	if err != nil {
		t.Fatal(err)
	}
	var n int32
	var lines []string
	for _, e := range evs.Items {
		d := max(e.Count, 1) - before[e.UID]
		if d <= 0 || e.Reason == "MissingClusterDNS" {
			continue
		}
		n += d
		line := fmt.Sprintf("%dx %s %s/%s %s: %s", d, e.InvolvedObject.Kind, e.Namespace, e.InvolvedObject.Name, e.Reason, e.Message)
		lines = append(lines, line)
		if d > maxRepeatedWarningSeen {
			t.Errorf("during %s: %s", what, line)
		}
	}
	t.Logf("%d Warning events during %s:\n%s", n, what, strings.Join(lines, "\n"))
	if n > maxUpgradeWarnings {
		t.Errorf("%d Warning events during %s, want at most %d", n, what, maxUpgradeWarnings)
	}
}

// checkCounting checks that the writer's log holds the counter 0, 1, 2, ... with no gap and
// no repeat, and returns its number of complete lines, which must be more than after.
func checkCounting(t *testing.T, path string, after int) int {
	t.Helper()
	var n int
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return false, err
		}
		lines := strings.Split(string(b), "\n")
		lines = lines[:len(lines)-1] // a line being written, or "" after the last newline
		for i, l := range lines {
			if l != strconv.Itoa(i) {
				t.Fatalf("%s: line %d is %q: the writer's file is not the one it wrote all along", path, i, l)
			}
		}
		n = len(lines)
		return n > after, fmt.Errorf("%s has %d lines, want more than %d", path, n, after)
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// checkWriting checks that the writer pod runs, never restarted, and still appends to the
// same file on the node, and returns its lines.
func checkWriting(t *testing.T, ns, pod, path string, after int) int {
	t.Helper()
	// Past after, then past that: the writer writes on now, not only before it was looked at.
	n := checkCounting(t, path, checkCounting(t, path, after))
	p, err := suite.Client.CoreV1().Pods(ns).Get(context.Background(), pod, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p.Status.Phase != v1.PodRunning || len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].RestartCount != 0 {
		b, _ := suite.Client.CoreV1().Pods(ns).GetLogs(pod, &v1.PodLogOptions{}).DoRaw(context.Background())
		t.Errorf("writer %s: phase %s, statuses %+v, log %q", pod, p.Status.Phase, p.Status.ContainerStatuses, b)
	}
	return n
}

// checkNoOrphans checks that every directory of ns's volumes, in both bases, belongs to one
// PV and every claim has one; retained directories (names) have none on purpose.
func checkNoOrphans(t *testing.T, ns string, retained ...string) {
	t.Helper()
	var dirs []string
	for _, base := range []string{basePath, btrfsBase} {
		entries, err := os.ReadDir(base)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ns+"-") && !slices.Contains(retained, e.Name()) {
				dirs = append(dirs, e.Name())
			}
		}
	}
	problems, err := framework.CheckOnePVPerClaim(context.Background(), suite.Client, ns, dirs)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
}

// Runs last: go test runs a package's tests in file order, files by name, and this is the last
// file; every other test needs dirpv installed (TestUpgradeFromRelease puts it back). Uninstalling
// leaves kubelet with no dirpv.io plugin registered.
func TestUninstallUnregistersFromKubelet(t *testing.T) {
	ctx := context.Background()
	if err := inst.Uninstall(ctx); err != nil {
		t.Fatal(err)
	}
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		n, err := suite.Client.StorageV1().CSINodes().Get(ctx, suite.Cluster.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return !slices.ContainsFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == "dirpv.io" }),
			fmt.Errorf("CSINode still lists %+v", n.Spec.Drivers)
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(suite.Cluster.PluginRegistryDir, "dirpv.io-reg.sock")); !os.IsNotExist(err) {
		t.Errorf("registration socket still there: %v", err)
	}
}
