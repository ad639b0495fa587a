package integration

// Clones: a claim whose dataSource is another claim starts as a copy of that claim's tree.
// These tests check what a user would: the clone binds, its tree is the source's, the source
// is protected while it is copied, refusals are events with nothing on disk, and a local
// clone placed on the wrong node goes back to the scheduler with an event naming the node to
// pin the pod to.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// cloningProtection is external-provisioner's finalizer on a claim being copied.
const cloningProtection = "provisioner.storage.kubernetes.io/cloning-protection"

// cloneOf makes the claim a clone of the claim source.
func cloneOf(source string) framework.ClaimOption {
	return func(c *v1.PersistentVolumeClaim) {
		c.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: source}
	}
}

// volumeDir is the directory of a bound local or NFS PV as the test sees it on the host.
func volumeDir(pv *v1.PersistentVolume) string {
	a := pv.Spec.CSI.VolumeAttributes
	if a["backend"] == "nfs" {
		return filepath.Join(suite.NFS.ExportDir, a["path"])
	}
	return filepath.Join(a["basePath"], a["path"])
}

// writeTree fills dir with every kind of entry a copy must keep: regular files with odd
// modes and owners, a large sparse file, hard links, a symlink to a file outside (which a copy
// must never follow), a relative symlink leading out, directories, a FIFO and an extended
// attribute.
func writeTree(t *testing.T, dir, outside string) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		must(t, err)
	}
	must(os.WriteFile(filepath.Join(dir, "a.txt"), []byte("hello clone\n"), 0o640))
	must(os.Chown(filepath.Join(dir, "a.txt"), 1234, 5678))
	must(os.Link(filepath.Join(dir, "a.txt"), filepath.Join(dir, "hard")))
	must(os.Mkdir(filepath.Join(dir, "sub"), 0o755))
	must(os.Chmod(filepath.Join(dir, "sub"), 0o1777))
	must(os.WriteFile(filepath.Join(dir, "sub", "setuid"), []byte("#!/bin/sh\n"), 0o755))
	must(os.Chmod(filepath.Join(dir, "sub", "setuid"), 0o4751))
	must(os.Link(filepath.Join(dir, "a.txt"), filepath.Join(dir, "sub", "hard2")))
	f, err := os.Create(filepath.Join(dir, "sparse"))
	must(err)
	_, err = f.WriteAt([]byte("head"), 0)
	must(err)
	_, err = f.WriteAt([]byte("tail"), 256<<20)
	must(err)
	must(f.Close())
	must(os.Symlink(filepath.Join(outside, "target"), filepath.Join(dir, "out")))
	must(os.Symlink("../../../etc/passwd", filepath.Join(dir, "sub", "up")))
	past := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	must(os.Chtimes(filepath.Join(dir, "a.txt"), past, past))
	must(unix.Mkfifo(filepath.Join(dir, "fifo"), 0o600))
	must(unix.Lsetxattr(filepath.Join(dir, "a.txt"), "user.dirpv-test", []byte("kept"), 0))
}

// checkSameTree fails unless clone holds what source does to a user (framework.TreeHash:
// names, types, modes, owners, sizes, contents, link targets, mtimes, xattrs, hard links)
// and the sparse file is still sparse.
func checkSameTree(t *testing.T, source, clone string) {
	t.Helper()
	want, err := framework.TreeHash(source)
	must(t, err)
	got, err := framework.TreeHash(clone)
	must(t, err)
	if d := framework.DiffSnapshots(want, got); len(d) > 0 {
		t.Errorf("clone differs from its source:\n%s", strings.Join(d, "\n"))
	}
	if !strings.Contains(want["a.txt"], "user.dirpv-test") {
		t.Errorf("TreeHash of the source shows no xattr on a.txt: %q", want["a.txt"])
	}
	var sp unix.Stat_t
	must(t, unix.Lstat(filepath.Join(clone, "sparse"), &sp))
	if used := sp.Blocks * 512; used > 1<<20 {
		t.Errorf("sparse file of %d bytes uses %d bytes in the clone: its holes were filled", sp.Size, used)
	}
}

// outsideDir makes a directory outside every base with a file a symlink in a volume points
// at, and returns it with a snapshot of it.
func outsideDir(t *testing.T) (string, map[string]string) {
	t.Helper()
	dir := t.TempDir()
	must(t, os.WriteFile(filepath.Join(dir, "target"), []byte("outside, never copied\n"), 0o600))
	return dir, snapshotTree(t, dir, nil)
}

// getClaim reads the claim as it is now.
func getClaim(t *testing.T, ns, name string) *v1.PersistentVolumeClaim {
	t.Helper()
	c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), name, metav1.GetOptions{})
	must(t, err)
	return c
}

// A user clones a claim: the clone binds with the source's tree and the size it asked for, on
// the source's node for a local claim (an NFS one, on the bind-mounted export, on the same
// export), the symlink's target outside is left alone, and the source keeps the
// cloning-protection finalizer until it is deleted, when dirpv removes it and the claim goes,
// leaving the clone whole.
func TestCloneClaim(t *testing.T) {
	for _, b := range lifecycleBackends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			ns := suite.NewNamespace(t)
			class, _ := b.class(t, nil)
			node := map[string]string{"local": nodeA}[b.name]
			suite.CreateClaim(t, ns, "src", class, append(slices.Clone(b.claim), framework.Request("1Gi"))...)
			_, srcPV := waitBound(t, ns, "src")
			outside, before := outsideDir(t)
			// An NFS volume's tree is written on the server's side, as any NFS client's writes end up.
			writeTree(t, volumeDir(srcPV), outside)

			suite.CreateClaim(t, ns, "copy", class, append(slices.Clone(b.claim), framework.Request("2Gi"), cloneOf("src"))...)
			_, pv := waitBound(t, ns, "copy")
			checkSameTree(t, volumeDir(srcPV), volumeDir(pv))
			if d := framework.DiffSnapshots(before, snapshotTree(t, outside, nil)); len(d) > 0 {
				t.Errorf("the copy changed the symlink's target outside the volume:\n%s", strings.Join(d, "\n"))
			}
			if got := pv.Spec.Capacity[v1.ResourceStorage]; got.String() != "2Gi" {
				t.Errorf("clone PV capacity %s, want the clone's request 2Gi", got.String())
			}
			if pv.Annotations["dirpv.io/node"] != node {
				t.Errorf("clone PV on node %q, want the source's %q", pv.Annotations["dirpv.io/node"], node)
			}

			if f := getClaim(t, ns, "src").Finalizers; !slices.Contains(f, cloningProtection) {
				t.Errorf("source claim finalizers %v, want %s (set before the copy)", f, cloningProtection)
			}
			deleteClaim(t, ns, "src")
			err := framework.WaitForDeleted(ctx, timeout, "source claim", func(ctx context.Context) (string, error) {
				c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "src", metav1.GetOptions{})
				if err != nil {
					return "", err
				}
				return fmt.Sprintf("finalizers %v", c.Finalizers), nil
			})
			must(t, err, ctrlProc)
			waitPVGone(t, srcPV.Name)
			if _, err := os.Stat(filepath.Join(volumeDir(pv), "sub", "setuid")); err != nil {
				t.Errorf("clone after its source was deleted: %v", err)
			}
		})
	}
}

// Refusals: a source larger than the clone's request, a source that is not there (it is in
// another namespace), a data source of a kind dirpv cannot copy. Each gives a clear event and
// nothing on disk; the source keeps no finalizer.
func TestCloneRefusals(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	other := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	suite.CreateClaim(t, ns, "src", class.Name, framework.OnNode(nodeA), framework.Request("2Gi"))
	waitBound(t, ns, "src")
	suite.CreateClaim(t, other, "elsewhere", class.Name, framework.OnNode(nodeA))
	waitBound(t, other, "elsewhere")
	dirs := entries(t, base)

	suite.CreateClaim(t, ns, "small", class.Name, framework.OnNode(nodeA), framework.Request("1Gi"), cloneOf("src"))
	suite.CreateClaim(t, ns, "foreign", class.Name, framework.OnNode(nodeA), cloneOf("elsewhere"))
	suite.CreateClaim(t, ns, "backup", class.Name, framework.OnNode(nodeA), func(c *v1.PersistentVolumeClaim) {
		c.Spec.DataSourceRef = &v1.TypedObjectReference{APIGroup: ptr.To("backup.example.com"), Kind: "Backup", Name: "nightly"}
	})
	for claim, want := range map[string]string{
		"small":   "PersistentVolumeClaim " + ns + "/src has 2Gi, more than the 1Gi this claim asks for",
		"foreign": "PersistentVolumeClaim " + ns + "/elsewhere does not exist",
		"backup":  "dataSource kind Backup of apiGroup backup.example.com is not supported",
	} {
		if _, err := framework.WaitForEvent(ctx, suite.Client, ns, "PersistentVolumeClaim", claim, "ProvisioningFailed", want, timeout); err != nil {
			t.Error(err)
			continue
		}
		noPVFor(t, ns, claim)
	}
	if got := entries(t, base); !slices.Equal(got, dirs) {
		t.Errorf("base holds %v after the refusals, want only the sources' %v", got, dirs)
	}
	if f := getClaim(t, ns, "src").Finalizers; slices.Contains(f, cloningProtection) {
		t.Errorf("source of a refused clone has finalizers %v: nothing was copied, it must stay deletable", f)
	}
}

// A local clone whose pod the scheduler put on another node than the source's: the claim goes
// back to the scheduler with an event that names the source's node and says to pin the pod
// there; once the user does, the claim is relabelled for that node (whose instance sees only
// the claims labelled for it) and binds there.
func TestCloneLocalOnOtherNodeReschedules(t *testing.T) {
	ctx := context.Background()
	const nodeB = "node-clone-b"
	procB := startNodeInstance(t, nodeB, suite.Work.BaseRoot)
	ns := suite.NewNamespace(t)
	class, _ := localClass(t, nil)
	suite.CreateClaim(t, ns, "src", class.Name, framework.OnNode(nodeA))
	_, srcPV := waitBound(t, ns, "src")
	must(t, os.WriteFile(filepath.Join(volumeDir(srcPV), "seed"), []byte("seed"), 0o644))

	suite.CreateClaim(t, ns, "copy", class.Name, cloneOf("src"))
	createPod(t, ns, "app", "copy", nodeB)
	want := "lives on node " + nodeA + ", and a local volume is copied on the node that holds it, but the scheduler chose node " + nodeB
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "copy", "ProvisioningFailed", want, procB)
	t.Logf("event: %s", ev.Message)
	if ev.Type != v1.EventTypeWarning || !strings.Contains(ev.Message, "make the pod that uses this claim run on node "+nodeA) ||
		!strings.Contains(ev.Message, "kubernetes.io/hostname In [host-"+nodeA+"]") {
		t.Errorf("event %s %q: want a Warning that says to pin the pod to %s", ev.Type, ev.Message, nodeA)
	}
	noPVFor(t, ns, "copy")
	// The controller, which sees the claim unplaced between two tries, finds nothing wrong
	// with it, and node-b runs the plugin.
	if hasEvent(ctx, t, ns, "copy", provisioner.ReasonUnservableClass, "dirpv cannot provision this claim") ||
		hasEvent(ctx, t, ns, "copy", "NodePluginMissing", "") {
		t.Errorf("the controller misreported the clone: %s", framework.EventsOf(ctx, suite.Client, ns, "PersistentVolumeClaim", "copy"))
	}

	// The user follows the event: the pod goes to the source's node.
	must(t, suite.Client.CoreV1().Pods(ns).Delete(ctx, "app", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	must(t, framework.WaitForPodDeleted(ctx, suite.Client, ns, "app", timeout))
	createPod(t, ns, "app2", "copy", nodeA)
	waitLabel(t, ns, "copy", nodeA)
	pvc, pv := waitBound(t, ns, "copy")
	if got := pvc.Annotations["volume.kubernetes.io/selected-node"]; got != nodeA {
		t.Errorf("clone placed on %q, want %s", got, nodeA)
	}
	if pv.Labels[provisioner.LabelNode] != nodeA || pv.Annotations[provisioner.AnnNode] != nodeA {
		t.Errorf("PV labels %v annotations %v, want node %s", pv.Labels, pv.Annotations, nodeA)
	}
	if b, err := os.ReadFile(filepath.Join(volumeDir(pv), "seed")); err != nil || string(b) != "seed" {
		t.Errorf("clone's seed file: %q, %v", b, err)
	}
}

// A clone whose copy outlasts Provision's wait is copied in the background, with a CopyStarted
// event on the claim: the node instance binds another claim while the copy runs, and the clone
// binds once its copy is complete. The copy is held halfway (failpoint.PauseDuringCopy) until
// the test has seen all of that, so the copy's speed decides nothing: an idle machine copied
// the 100k files this test used to rely on within Provision's wait.
func TestCloneLargeTreeInBackground(t *testing.T) {
	ctx := context.Background()
	const (
		files = 2_000
		point = failpoint.PauseDuringCopy
	)
	release := filepath.Join(t.TempDir(), "release")
	node := uniqueName("node-clone-background")
	proc, ns, _ := cloneStoppedAt(t, node, point, files, failpoint.ReleaseEnv+"="+release)
	start := time.Now()
	// Provision gave the copy to the background: the lib says so on the claim.
	waitEvent(t, ns, "PersistentVolumeClaim", "copy", "ProvisioningFailed", "in the background; the claim binds once the copy is complete", proc)
	waitEvent(t, ns, "PersistentVolumeClaim", "copy", provisioner.ReasonCopyStarted, "PersistentVolumeClaim "+ns+"/src into the new volume", proc)
	suite.CreateClaim(t, ns, "other", *getClaim(t, ns, "src").Spec.StorageClassName, framework.OnNode(node))
	waitBound(t, ns, "other")
	if log := proc.Tail(50000); !strings.Contains(log, "failpoint "+point+" reached") || strings.Contains(log, "failpoint "+point+" released") {
		t.Fatalf("the copy was not held at %s while the other claim bound:\n%s", point, proc.Tail(3000))
	}
	if c := getClaim(t, ns, "copy"); c.Status.Phase != v1.ClaimPending {
		t.Fatalf("clone is %s while its copy is held, want Pending", c.Status.Phase)
	}
	must(t, os.WriteFile(release, nil, 0o644))
	pvc, err := framework.WaitForPVCBound(ctx, suite.Client, ns, "copy", 5*time.Minute)
	must(t, err, proc)
	t.Logf("clone of %d files bound after %s; annotations %v", files, time.Since(start).Round(time.Millisecond), pvc.Annotations)
	pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	must(t, err)
	if n := countFiles(t, volumeDir(pv)); n != files {
		t.Errorf("clone holds %d files, want %d", n, files)
	}
}

// countFiles counts the regular files beneath dir.
func countFiles(t *testing.T, dir string) int {
	t.Helper()
	n := 0
	err := filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			n++
		}
		return nil
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return n
}

// cloneStoppedAt starts a node instance armed to stop at point (a failpoint of the copy) half
// way through files, and on it a claim "src" holding files and a claim "copy" cloning it. It
// returns the instance, the namespace and the class's base. env is more of the instance's
// environment. node must be unique to the run (uniqueName): an instance's log is appended to
// under its name, and a test judges what the log says.
func cloneStoppedAt(t *testing.T, node, point string, files int, env ...string) (*framework.Process, string, string) {
	t.Helper()
	proc, ns, class, base := sourceStoppedAt(t, node, point, files, env...)
	suite.CreateClaim(t, ns, "copy", class, framework.OnNode(node), cloneOf("src"))
	return proc, ns, base
}

// sourceStoppedAt is cloneStoppedAt without the clone: the instance, the namespace, the
// class's name and base, for a test that copies "src" its own way.
func sourceStoppedAt(t *testing.T, node, point string, files int, env ...string) (proc *framework.Process, ns, class, base string) {
	t.Helper()
	proc = startNodeInstance(t, node, suite.Work.BaseRoot, append([]string{failpoint.Env + "=" + point + ":" + fmt.Sprint(files/2)}, env...)...)
	ns = suite.NewNamespace(t)
	c, base := localClass(t, nil)
	suite.CreateClaim(t, ns, "src", c.Name, framework.OnNode(node))
	_, srcPV := waitBound(t, ns, "src")
	must(t, framework.FillEmptyFiles(volumeDir(srcPV), files))
	return proc, ns, c.Name, base
}

// A node instance killed in the middle of a clone's copy (failpoint.DuringCopy), then
// restarted: the half-made copy under its temporary name is no PV, and after the restart the
// clone binds with a complete copy and nothing temporary is left.
func TestCloneKilledMidCopyRestarts(t *testing.T) {
	const (
		files = 20_000
		point = failpoint.DuringCopy
	)
	proc, ns, base := cloneStoppedAt(t, uniqueName("node-clone-kill"), point, files)
	waitKilledAt(t, proc, point)
	temps := tempDirs(t, base)
	if len(temps) != 1 {
		t.Fatalf("base after the kill holds %v, want the source and one temporary directory", entries(t, base))
	}
	if n := countFiles(t, filepath.Join(base, temps[0])); n == 0 || n >= files {
		t.Errorf("the killed copy holds %d of %d files, want a part", n, files)
	}
	if pvs := pvsOf(t, ns); len(pvs) != 1 {
		t.Fatalf("PVs after the kill: %v, want only the source's", pvs)
	}

	proc.Env = nil
	must(t, proc.Restart())
	_, pv := waitBound(t, ns, "copy")
	if n := countFiles(t, volumeDir(pv)); n != files {
		t.Errorf("clone after the restart holds %d files, want %d", n, files)
	}
	if left := tempDirs(t, base); len(left) != 0 {
		t.Errorf("temporary directories left after the restart: %v", left)
	}
}

// A clone whose claim is deleted while its copy runs: the copy is cancelled at once, not left
// to run to its end (or to --clone-timeout) for nobody, and what it copied is removed. The
// copy is held halfway by failpoint.PauseDuringCopy, which lets it go on only once it is
// cancelled, so the test knows the copy was under way when the claim went.
func TestCloneCancelledWhenItsClaimIsDeleted(t *testing.T) {
	const (
		files = 200
		point = failpoint.PauseDuringCopy
	)
	proc, ns, base := cloneStoppedAt(t, uniqueName("node-clone-cancel"), point, files)
	waitHeldAt(t, proc, point)
	temps := tempDirs(t, base)
	if len(temps) != 1 {
		t.Fatalf("base during the copy holds %v, want the source and one temporary directory", entries(t, base))
	}
	if n := countFiles(t, filepath.Join(base, temps[0])); n == 0 || n >= files {
		t.Errorf("the paused copy holds %d of %d files, want a part", n, files)
	}
	if n := copiesRunning(t, proc); n != 1 {
		t.Errorf("dirpv_copies_running %v during the copy, want 1", n)
	}

	deleteClaim(t, ns, "copy")
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		if n := copiesRunning(t, proc); n != 0 {
			return false, fmt.Errorf("dirpv_copies_running is %v", n)
		}
		if left := tempDirs(t, base); len(left) != 0 {
			return false, fmt.Errorf("the copy's temporary directory is still there: %v", left)
		}
		return true, nil
	})
	must(t, err, proc)
	if log := proc.Tail(50000); !strings.Contains(log, "failpoint "+point+" released: context canceled") {
		t.Errorf("the copy did not end by being cancelled:\n%s", log)
	}
	// The base is the test's, but -count runs share it: only this run's names are judged.
	for _, e := range entries(t, base) {
		if strings.HasPrefix(e, ns+"-copy-") {
			t.Errorf("base after the cancelled copy holds %s, a volume for the deleted claim", e)
		}
	}
	if pvs := pvsOf(t, ns); len(pvs) != 1 {
		t.Errorf("PVs after the cancelled copy: %v, want only the source's", pvs)
	}
}

// copiesRunning reads dirpv_copies_running from proc.
func copiesRunning(t *testing.T, proc *framework.Process) float64 {
	t.Helper()
	m, err := framework.Scrape(context.Background(), proc)
	must(t, err)
	n, ok := m["dirpv_copies_running"]
	if !ok {
		t.Fatal("no dirpv_copies_running on /metrics")
	}
	return n
}
