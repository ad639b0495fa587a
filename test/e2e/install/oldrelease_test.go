package install

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	snapv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/framework"
)

// An install of framework.OldRelease, with volumes of every kind and pods writing to two of them, is
// upgraded in place to this checkout as docs/operations.md says, then downgraded again: once
// with the kustomize overlays applied over each other, once with helm upgrade from
// OldRelease's chart to this one (the same checks, upgradeFromRelease). Runs after the tests
// of the suite's earlier files (file order): it replaces the suite's install by OldRelease's
// and leaves this checkout's installed again.
func TestUpgradeFromRelease(t *testing.T) {
	ctx := context.Background()
	start := time.Now()
	rel, err := framework.PrepareRelease(ctx, framework.OldRelease, t.TempDir(), t.Logf)
	must(t, err)
	must(t, suite.Cluster.ImportImage(ctx, rel.ImageTar))
	ds, err := suite.Client.AppsV1().DaemonSets("dirpv").Get(ctx, "dirpv-node", metav1.GetOptions{})
	must(t, err)
	newImage := ds.Spec.Template.Spec.Containers[0].Image
	newOpts := deploy.E2ELocalOptions{Image: newImage, NodeArgs: []string{"--quota-check-period=" + quotaCheckPeriod.String()}}
	oldOpts := deploy.E2ELocalOptions{Root: rel.DeployRoot, Image: rel.Image}
	// OldRelease's host-network Deployments lack the one-at-a-time rollout: on this one-node
	// cluster the downgrade adds it, as docs/operations.md ("Downgrading") tells users to,
	// else it would wait for ever on a Pending pod.
	downOpts := oldOpts
	downOpts.NoSurge = true
	render := func(opts deploy.E2ELocalOptions) []*unstructured.Unstructured {
		t.Helper()
		objs, err := framework.RenderInstall(ctx, suite.Cluster, opts)
		must(t, err)
		return objs
	}
	newObjs, oldObjs, downObjs := render(newOpts), render(oldOpts), render(downOpts)
	env := upgradeEnv{rel: rel, newImage: newImage, newObjs: newObjs, oldObjs: oldObjs}

	// kubectl apply --server-side of each version's overlay over the other's.
	apply := func(objs []*unstructured.Unstructured) func(t *testing.T) {
		return func(t *testing.T) {
			_, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, objs, "")
			must(t, err)
		}
	}
	t.Run("kustomize", func(t *testing.T) {
		upgradeFromRelease(t, env, upgradeMethod{install: apply(oldObjs), upgrade: apply(newObjs), downgrade: apply(downObjs)})
	})

	// helm install of OldRelease's chart, helm upgrade to this checkout's, and back, each with
	// a post-renderer that adapts the chart to this cluster as the overlays are adapted.
	helmBin, err := deploy.Tool(ctx, "helm", true)
	must(t, err)
	helm := func(chartRoot string, opts deploy.E2ELocalOptions, args ...string) func(t *testing.T) {
		opts.ChartSnapshots = true
		return func(t *testing.T) {
			post, err := framework.HelmPostRenderer(ctx, suite.Cluster, opts, t.TempDir())
			must(t, err)
			args = append(args, "dirpv", filepath.Join(chartRoot, "deploy", "helm", "dirpv"), "--namespace", "dirpv",
				"--kubeconfig", suite.Cluster.Kubeconfig, "--post-renderer", post)
			if out, err := deploy.Helm(ctx, helmBin, args...); err != nil {
				t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
			}
		}
	}
	// Values set at install (logLevel, snapshots.enabled) are kept: --reset-then-reuse-values
	// takes this chart's defaults for values the old chart lacked, which --reuse-values would
	// leave unset.
	//
	// The old chart's snapshots.enabled rendered the snapshot CRDs in its templates, next to
	// the VolumeSnapshotClasses that need them, and helm maps every object of a release before
	// it creates any ("ensure CRDs are installed first"): its users had to create the CRDs
	// first, labelled for the release to adopt. The release then owns them, which this chart's
	// upgrade must not delete them for (charts/snapshot-crds/templates/release-owned-crds.yaml).
	installOld := helm(rel.DeployRoot, oldOpts, "install", "--create-namespace", "--set", "logLevel=3", "--set", "snapshots.enabled=true")
	// This chart installed as a user does on a cluster without the CRDs (helm creates them
	// from crds/), in place of the suite's install that the test replaced.
	installNew := helm(framework.RepoRoot(), newOpts, "install", "--create-namespace", "--set", "snapshots.enabled=true")
	t.Run("helm", func(t *testing.T) {
		upgradeFromRelease(t, env, upgradeMethod{
			install: func(t *testing.T) {
				var crds []*unstructured.Unstructured
				for _, o := range oldObjs {
					if o.GetKind() == "CustomResourceDefinition" {
						crd := o.DeepCopy()
						labels, annotations := crd.GetLabels(), crd.GetAnnotations()
						labels["app.kubernetes.io/managed-by"] = "Helm"
						annotations["meta.helm.sh/release-name"], annotations["meta.helm.sh/release-namespace"] = "dirpv", "dirpv"
						crd.SetLabels(labels)
						crd.SetAnnotations(annotations)
						crds = append(crds, crd)
					}
				}
				apply(crds)(t)
				installOld(t)
			},
			upgrade:   helm(framework.RepoRoot(), newOpts, "upgrade", "--reset-then-reuse-values"),
			downgrade: helm(rel.DeployRoot, downOpts, "upgrade", "--reset-then-reuse-values"),
			helm:      true,
			reinstall: installNew,
			afterUpgrade: func(t *testing.T) {
				ds, err := suite.Client.AppsV1().DaemonSets("dirpv").Get(ctx, "dirpv-node", metav1.GetOptions{})
				must(t, err)
				if args := ds.Spec.Template.Spec.Containers[0].Args; !slices.Contains(args, "--v=3") {
					t.Errorf("the node plugin's args after helm upgrade %q: the install's logLevel=3 is lost", args)
				}
			},
		})
	})
	checkFreshHelmInstall(t)
	t.Logf("upgrade tests took %s", time.Since(start).Round(time.Millisecond))
}

// checkFreshHelmInstall checks what the helm subtest's reinstall (a helm install with
// snapshots.enabled on a cluster without the snapshot CRDs) left: the CRDs, which the release
// does not own (its uninstall must not delete other installs' snapshots), the classes, and a
// snapshot of a claim made with them.
func checkFreshHelmInstall(t *testing.T) {
	ctx := context.Background()
	start := time.Now()
	cfg, err := clientcmd.BuildConfigFromFlags("", suite.Cluster.Kubeconfig)
	must(t, err)
	dyn, err := dynamic.NewForConfig(cfg)
	must(t, err)
	crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	for _, name := range []string{"volumesnapshotclasses", "volumesnapshotcontents", "volumesnapshots"} {
		crd, err := crds.Get(ctx, name+".snapshot.storage.k8s.io", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("after helm install with snapshots.enabled: %v", err)
		}
		if owner := crd.GetAnnotations()["meta.helm.sh/release-name"]; owner != "" {
			t.Errorf("CRD %s belongs to helm release %q; want it outside the release (crds/)", crd.GetName(), owner)
		}
	}
	snaps := snapClient(t)
	for _, name := range []string{"dirpv-local", "dirpv-nfs"} {
		if _, err := snaps.SnapshotV1().VolumeSnapshotClasses().Get(ctx, name, metav1.GetOptions{}); err != nil {
			t.Errorf("after helm install with snapshots.enabled: %v", err)
		}
	}
	ns := suite.NewNamespace(t)
	suite.CreateClaim(t, ns, "data", "")
	suite.CreatePod(t, suite.BusyboxPod(ns, "writer", "data", "echo data > /data/file", false))
	podDone(t, ns, "writer")
	if _, err := snaps.SnapshotV1().VolumeSnapshots(ns).Create(ctx, &snapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: "snap", Namespace: ns},
		Spec:       snapv1.VolumeSnapshotSpec{Source: snapv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To("data")}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSnapshotReady(t, ns, "snap")
	// dirpv must be running to remove the finalizers of the snapshot and its content: the
	// namespace goes now, not when the test ends (the suite's uninstall follows).
	must(t, suite.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}))
	must(t, waitNamespaceGone(ctx, ns))
	t.Logf("the fresh helm install's snapshot checked in %s", time.Since(start).Round(time.Millisecond))
}

// upgradeEnv is what both runs of TestUpgradeFromRelease share: the old release and the
// objects of both versions' overlays (which the charts render too).
type upgradeEnv struct {
	rel              *framework.Release
	newImage         string
	newObjs, oldObjs []*unstructured.Unstructured
}

// upgradeMethod is how a user installs OldRelease on a cluster without dirpv, upgrades it to
// this checkout, and downgrades it again.
type upgradeMethod struct {
	install, upgrade, downgrade func(t *testing.T)
	// helm: the install is a helm release, whose downgrade removes what only this version
	// installs, and which is uninstalled before this checkout's overlay is applied again.
	helm bool
	// afterUpgrade, if set, checks what is particular to the method after the upgrade.
	afterUpgrade func(t *testing.T)
	// reinstall installs this checkout again at the end; nil applies its overlay.
	reinstall func(t *testing.T)
}

// upgradeFromRelease installs OldRelease with m, makes volumes of every kind with it, and
// checks them through m's upgrade and downgrade.
//
// Through the upgrade: the writing pods keep running with no failed write, appending to the
// same files the host sees; new pods mount the old volumes; an old claim grows past its old
// size; the old version's clone is read and deleted; a claim is restored from a
// VolumeSnapshot the old version made, which is then deleted; old claims are deleted,
// retained and archived as their classes say; the node's CSIStorageCapacity objects and the
// dirpv.io/node labels are there again; no directory is left without a PV; and the Warning
// events of the upgrade are listed and bounded.
//
// Downgrade: the writing pods keep writing, and the old version mounts, and deletes, a volume
// this version made. What a user must know, in docs/operations.md ("Downgrading") and checked
// here: `kubectl apply` removes nothing, so the node-write admission policy this version added
// stays (and still admits the old node plugin's writes, which the deletion shows); helm
// removes it. Last, the old version deletes the test's namespace with all its volumes.
func upgradeFromRelease(t *testing.T, env upgradeEnv, m upgradeMethod) {
	ctx := context.Background()
	c := suite.Client
	start := time.Now()
	rel, newImage, newObjs, oldObjs := env.rel, env.newImage, env.newObjs, env.oldObjs
	step := func(f func(t *testing.T), image string) {
		t.Helper()
		f(t)
		must(t, framework.WaitRolledOut(ctx, c, "dirpv", image, timeout))
	}

	// A user's cluster has the old version only: this checkout's install goes first, and
	// comes back at the end whatever happens (cleanups run last first: after the namespace).
	// The namespace must be gone first: the finalizers of its claims and snapshots (cloning
	// and snapshot-source protection, the snapshot's content) are removed by the dirpv that
	// runs, and one replaced, then uninstalled, before it got to them leaves them for ever,
	// and with them the namespace and the VolumeSnapshot CRD that the suite's uninstall
	// waits for.
	must(t, inst.Uninstall(ctx))
	var ns string
	t.Cleanup(func() {
		// The writers' shell ignores SIGTERM: without this each would take its grace period.
		if ns != "" {
			zero := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}
			if err := c.CoreV1().Pods(ns).DeleteCollection(ctx, zero, metav1.ListOptions{}); err != nil {
				t.Errorf("delete the test's pods: %v", err)
			}
		}
		if err := waitNamespaceGone(ctx, ns); err != nil {
			t.Errorf("the test's namespace, deleted by the version installed last: %v", err)
		}
		if m.helm {
			// Pods first, as docs/install.md uninstalls; the namespace takes helm's record.
			if helmInst, err := framework.Installed(suite.Cluster.Kubeconfig, newObjs); err != nil {
				t.Errorf("uninstall the helm release: %v", err)
			} else if err := helmInst.Uninstall(ctx); err != nil {
				t.Errorf("uninstall the helm release: %v", err)
			}
		}
		if m.reinstall != nil {
			m.reinstall(t)
		} else if _, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, newObjs, ""); err != nil {
			t.Errorf("reinstall this checkout: %v", err)
		}
		if err := framework.WaitRolledOut(ctx, c, "dirpv", newImage, timeout); err != nil {
			t.Errorf("reinstall this checkout: %v", err)
		}
	})
	m.install(t)
	must(t, framework.WaitForDriverRegistered(ctx, c, suite.Cluster.NodeName, timeout))
	must(t, framework.WaitRolledOut(ctx, c, "dirpv", rel.Image, timeout))
	t.Logf("%s installed in %s", rel.Image, time.Since(start).Round(time.Millisecond))

	// Volumes made by the old version.
	ns = suite.NewNamespace(t)
	suite.CreateClass(t, "upgrade-btrfs", map[string]string{"backend": "local", "basePath": btrfsBase, "capacityEnforcement": "required"},
		framework.AllowVolumeExpansion)
	suite.CreateClass(t, "upgrade-retain", map[string]string{"backend": "local", "basePath": basePath, "onDelete": "retain"})
	suite.CreateClass(t, "upgrade-archive", map[string]string{"backend": "local", "basePath": basePath, "onDelete": "archive"})
	suite.CreateClaim(t, ns, "host", "")
	suite.CreatePod(t, suite.BusyboxPod(ns, "host-writer", "host", framework.WriterScript, false))
	suite.CreateClaim(t, ns, "btrfs", "upgrade-btrfs", framework.Request("32Mi"))
	suite.CreatePod(t, suite.BusyboxPod(ns, "btrfs-writer", "btrfs", framework.WriterScript, false))
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
	must(t, framework.SetClaimSize(ctx, c, ns, "btrfs", "48Mi"))
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
	_, err := snaps.SnapshotV1().VolumeSnapshots(ns).Create(ctx, &snapv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: "snap", Namespace: ns},
		Spec:       snapv1.VolumeSnapshotSpec{Source: snapv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To("host")}},
	}, metav1.CreateOptions{})
	must(t, err)
	waitSnapshotReady(t, ns, "snap")

	capsBefore := nodeCapacities(t)
	labelsBefore := nodeLabels(t, ns)
	oldPods := dirpvPods(t)
	warningsBefore := warningCounts(t)
	hostLines := checkCounting(t, filepath.Join(hostDir, "log"), 0)
	btrfsLines := checkCounting(t, filepath.Join(btrfsDir, "log"), 0)

	// The upgrade, as docs/operations.md says: this version's overlay applied over the old one.
	upgradeStart := time.Now()
	step(m.upgrade, newImage)
	if m.afterUpgrade != nil {
		m.afterUpgrade(t)
	}
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
	must(t, framework.SetClaimSize(ctx, c, ns, "btrfs", "96Mi"))
	if _, err := framework.WaitForClaimResized(ctx, c, ns, "btrfs", "96Mi", timeout); err != nil {
		t.Fatalf("%v\n%s", err, framework.EventsOf(ctx, c, ns, "PersistentVolumeClaim", "btrfs"))
	}
	suite.CreatePod(t, suite.BusyboxPod(ns, "filler", "btrfs", "dd if=/dev/zero of=/data/big bs=1M count=64 conv=fsync 2>&1 && echo fill-ok", false))
	if out := podDone(t, ns, "filler"); !strings.Contains(out, "fill-ok") {
		t.Errorf("64Mi into the old claim grown from 48Mi to 96Mi: %q", out)
	}
	// The old version's clone: a new pod reads it, and deleting it removes its directory.
	cloneDir := volumeDir(t, ns, "clone")
	suite.CreatePod(t, suite.BusyboxPod(ns, "clone-reader-new", "clone", "cat /data/seed", false))
	if out := podDone(t, ns, "clone-reader-new"); out != "seed\n" {
		t.Errorf("a new pod on the old version's clone reads %q, want seed", out)
	}
	// Pods that ended still hold their claim (kube-controller-manager's PVC protection).
	deletePod(t, ns, "clone-reader")
	deletePodAndClaim(t, ns, "clone-reader-new", "clone")
	if _, err := os.Stat(cloneDir); !os.IsNotExist(err) {
		t.Errorf("deleting the old version's clone left %s: %v", cloneDir, err)
	}
	// Restore from the old version's snapshot, which then goes with its content.
	suite.CreateClaim(t, ns, "restored", "", func(pvc *v1.PersistentVolumeClaim) {
		pvc.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"}
	})
	suite.CreatePod(t, suite.BusyboxPod(ns, "restore-reader", "restored", "cat /data/seed", false))
	if out := podDone(t, ns, "restore-reader"); out != "seed\n" {
		t.Errorf("the claim restored from the old snapshot holds %q, want seed", out)
	}
	deleteSnapshot(t, snaps, ns, "snap")
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

	// The downgrade, with the rollout the old version lacks (downOpts).
	warningsBefore = warningCounts(t)
	step(m.downgrade, rel.Image)
	checkWriting(t, ns, "host-writer", filepath.Join(hostDir, "log"), hostLines)
	checkWriting(t, ns, "btrfs-writer", filepath.Join(btrfsDir, "log"), btrfsLines)
	// kubectl apply prunes nothing: what only this version installs stays; helm removes it.
	var newOnly []*unstructured.Unstructured
	for _, o := range newObjs {
		if !slices.ContainsFunc(oldObjs, func(old *unstructured.Unstructured) bool {
			return old.GetKind() == o.GetKind() && old.GetName() == o.GetName()
		}) {
			newOnly = append(newOnly, o)
		}
	}
	if len(newOnly) == 0 {
		t.Error("this version installs nothing the old one does not: the downgrade's pruning is not checked")
	}
	left, err := framework.Installed(suite.Cluster.Kubeconfig, newOnly)
	must(t, err)
	kept, err := left.Existing(ctx)
	must(t, err)
	for _, o := range newOnly {
		stays := slices.Contains(kept, o)
		t.Logf("%s %s after the downgrade: there %v", o.GetKind(), o.GetName(), stays)
		if stays == m.helm {
			t.Errorf("%s %s after the downgrade: there %v, want %v", o.GetKind(), o.GetName(), stays, !m.helm)
		}
	}
	// The old version mounts and deletes a volume this version made.
	freshDir := volumeDir(t, ns, "fresh")
	suite.CreatePod(t, suite.BusyboxPod(ns, "fresh-reader", "fresh", "cat /data/seed", false))
	if out := podDone(t, ns, "fresh-reader"); out != "fresh\n" {
		t.Errorf("after the downgrade a pod on a claim of this version reads %q, want fresh", out)
	}
	// A pod that ended still holds its claim (kube-controller-manager's PVC protection).
	deletePod(t, ns, "fresh-writer")
	deletePodAndClaim(t, ns, "fresh-reader", "fresh")
	if _, err := os.Stat(freshDir); !os.IsNotExist(err) {
		t.Errorf("after the downgrade, deleting a claim of this version left %s: %v", freshDir, err)
	}
	checkNoOrphans(t, ns, filepath.Base(dirs["kept"]))
	checkWarnings(t, warningsBefore, "the downgrade")
	t.Logf("upgrade test took %s", time.Since(start).Round(time.Millisecond))
}

func snapClient(t *testing.T) snapclientset.Interface {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", suite.Cluster.Kubeconfig)
	must(t, err)
	s, err := snapclientset.NewForConfig(cfg)
	must(t, err)
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
	must(t, err)
	return got
}

// nodeLabels returns the dirpv.io/node label of every claim and PV of ns.
func nodeLabels(t *testing.T, ns string) map[string]string {
	t.Helper()
	ctx := context.Background()
	got := map[string]string{}
	claims, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
	must(t, err)
	for _, c := range claims.Items {
		got["claim "+c.Name] = c.Labels["dirpv.io/node"]
		if c.Spec.VolumeName != "" {
			pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, c.Spec.VolumeName, metav1.GetOptions{})
			must(t, err)
			got["pv of "+c.Name] = pv.Labels["dirpv.io/node"]
		}
	}
	return got
}

// dirpvPods returns dirpv's pods by UID.
func dirpvPods(t *testing.T) map[types.UID]string {
	t.Helper()
	pods, err := suite.Client.CoreV1().Pods("dirpv").List(context.Background(), metav1.ListOptions{})
	must(t, err)
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
	must(t, err)
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
	must(t, err)
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
	n, err := framework.CheckCounting(context.Background(), readFile(path), after, timeout)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}

// checkWriting checks that the writer pod runs, never restarted, and still appends to the
// same file on the node, and returns its lines.
func checkWriting(t *testing.T, ns, pod, path string, after int) int {
	t.Helper()
	n, err := framework.CheckWriting(context.Background(), suite.Client, ns, pod, readFile(path), after, timeout)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}

func readFile(path string) func(context.Context) ([]byte, error) {
	return func(context.Context) ([]byte, error) { return os.ReadFile(path) }
}

// checkNoOrphans checks that every directory of ns's volumes, in both bases, belongs to one
// PV and every claim has one; retained directories (names) have none on purpose.
func checkNoOrphans(t *testing.T, ns string, retained ...string) {
	t.Helper()
	var dirs []string
	for _, base := range []string{basePath, btrfsBase} {
		entries, err := os.ReadDir(base)
		must(t, err)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ns+"-") && !slices.Contains(retained, e.Name()) {
				dirs = append(dirs, e.Name())
			}
		}
	}
	problems, err := framework.CheckOnePVPerClaim(context.Background(), suite.Client, ns, dirs)
	must(t, err)
	for _, p := range problems {
		t.Error(p)
	}
}

// deleteSnapshot deletes a VolumeSnapshot and waits until it and its VolumeSnapshotContent
// are gone: the snapshot controller and dirpv deleted the snapshot's data.
func deleteSnapshot(t *testing.T, snaps snapclientset.Interface, ns, name string) {
	t.Helper()
	ctx := context.Background()
	vs, err := snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{})
	must(t, err)
	must(t, snaps.SnapshotV1().VolumeSnapshots(ns).Delete(ctx, name, metav1.DeleteOptions{}))
	content := ptr.Deref(vs.Status.BoundVolumeSnapshotContentName, "")
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		if _, err := snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return false, fmt.Errorf("VolumeSnapshot %s/%s still there (%v)", ns, name, err)
		}
		if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, content, metav1.GetOptions{}); content != "" && !apierrors.IsNotFound(err) {
			return false, fmt.Errorf("VolumeSnapshotContent %s still there (%v)", content, err)
		}
		return true, nil
	})
	must(t, err)
}

// waitNamespaceGone waits until namespace ns (none if empty) is deleted, and says what holds it.
func waitNamespaceGone(ctx context.Context, ns string) error {
	if ns == "" {
		return nil
	}
	return framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		n, err := suite.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, err
		}
		return false, fmt.Errorf("namespace %s still there: %+v", ns, n.Status.Conditions)
	})
}
