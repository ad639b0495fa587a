package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
)

// snapshotClass creates a VolumeSnapshotClass of dirpv.io with the deletion policy.
func snapshotClass(t *testing.T, policy snapshotv1.DeletionPolicy) string {
	t.Helper()
	name := className(t)
	c := &snapshotv1.VolumeSnapshotClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Driver: "dirpv.io", DeletionPolicy: policy}
	_, err := snaps.SnapshotV1().VolumeSnapshotClasses().Create(context.Background(), c, metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		snaps.SnapshotV1().VolumeSnapshotClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return name
}

// createSnapshot creates a VolumeSnapshot of the claim.
func createSnapshot(t *testing.T, ns, name, claim, class string) *snapshotv1.VolumeSnapshot {
	t.Helper()
	vs, err := snaps.SnapshotV1().VolumeSnapshots(ns).Create(context.Background(), &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: snapshotv1.VolumeSnapshotSpec{
			Source:                  snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: &claim},
			VolumeSnapshotClassName: &class,
		},
	}, metav1.CreateOptions{})
	must(t, err)
	return vs
}

// takeSnapshot creates a VolumeSnapshot of the claim and waits until it is ready to use; it
// returns it and its bound content.
func takeSnapshot(t *testing.T, ns, name, claim, class string) (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	t.Helper()
	createSnapshot(t, ns, name, claim, class)
	return waitSnapshotReady(t, ns, name)
}

// waitSnapshotReady waits until the VolumeSnapshot is ready to use; it returns it and its
// bound content.
func waitSnapshotReady(t *testing.T, ns, name string) (*snapshotv1.VolumeSnapshot, *snapshotv1.VolumeSnapshotContent) {
	t.Helper()
	ctx := context.Background()
	var vs *snapshotv1.VolumeSnapshot
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		vs, err = snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return vs.Status != nil && vs.Status.ReadyToUse != nil && *vs.Status.ReadyToUse, nil
	})
	if err != nil {
		t.Fatalf("VolumeSnapshot %s not ready: %v (status %+v)\n%s\n--- node-a log tail:\n%s", name, err, vs.Status,
			framework.EventsOf(ctx, suite.Client, ns, "VolumeSnapshot", name), nodeProc.Tail(3000))
	}
	content, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, *vs.Status.BoundVolumeSnapshotContentName, metav1.GetOptions{})
	must(t, err)
	return vs, content
}

// snapshotDir is where the snapshot of content lives on this host.
func snapshotDir(t *testing.T, content *snapshotv1.VolumeSnapshotContent) string {
	t.Helper()
	if content.Status == nil || content.Status.SnapshotHandle == nil {
		t.Fatalf("content %s has no snapshot handle", content.Name)
	}
	h, err := volume.ParseSnapshotHandle(*content.Status.SnapshotHandle)
	must(t, err)
	if h.Backend == volume.BackendNFS {
		return filepath.Join(suite.NFS.ExportDir, strings.TrimPrefix(h.Share, suite.NFS.Share), ".dirpv-snapshots", h.Name, "tree")
	}
	return filepath.Join(h.BasePath, ".dirpv-snapshots", h.Name, "tree")
}

func exists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Lstat(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return err == nil
}

// A user snapshots a local claim: node-a's dirpv makes the snapshot's directory beside the
// volumes. With deletionPolicy Delete, deleting the VolumeSnapshot removes the directory; with
// Retain, the content and the directory stay. (What the API shows of both policies, and a
// retained snapshot imported again by its handle, the conformance tier's snapshottable
// patterns check on dirpv-local, Dynamic and Preprovisioned, Delete and Retain.)
func TestLocalSnapshotDeletionPolicy(t *testing.T) {
	for _, policy := range []snapshotv1.DeletionPolicy{snapshotv1.VolumeSnapshotContentDelete, snapshotv1.VolumeSnapshotContentRetain} {
		t.Run(string(policy), func(t *testing.T) {
			ctx := context.Background()
			ns := suite.NewNamespace(t)
			class, base := localClass(t, nil)
			vsClass := snapshotClass(t, policy)
			suite.CreateClaim(t, ns, "src", class.Name, framework.OnNode(nodeA))
			_, pv := waitBound(t, ns, "src")
			src := filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"])
			must(t, os.WriteFile(filepath.Join(src, "data"), []byte("hello"), 0o644))

			_, content := takeSnapshot(t, ns, "snap", "src", vsClass)
			dir := snapshotDir(t, content)
			if !strings.HasPrefix(dir, base+"/") || !exists(t, dir) {
				t.Fatalf("snapshot directory %s missing or outside the base %s", dir, base)
			}

			must(t, snaps.SnapshotV1().VolumeSnapshots(ns).Delete(ctx, "snap", metav1.DeleteOptions{}))
			if policy == snapshotv1.VolumeSnapshotContentDelete {
				err := framework.WaitForDeleted(ctx, timeout, "content "+content.Name, func(ctx context.Context) (string, error) {
					_, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, content.Name, metav1.GetOptions{})
					return "", err
				})
				must(t, err)
				if exists(t, dir) {
					t.Errorf("snapshot directory %s left after its VolumeSnapshot was deleted (Delete)", dir)
				}
				return
			}
			// Retain: the VolumeSnapshot goes, its content is kept (unbound) with the directory.
			err := framework.WaitForDeleted(ctx, timeout, "VolumeSnapshot snap", func(ctx context.Context) (string, error) {
				_, err := snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, "snap", metav1.GetOptions{})
				return "", err
			})
			must(t, err)
			if _, err := snaps.SnapshotV1().VolumeSnapshotContents().Get(ctx, content.Name, metav1.GetOptions{}); err != nil {
				t.Errorf("content of a Retain snapshot: %v", err)
			}
			if !exists(t, dir) {
				t.Errorf("snapshot directory %s removed although the class says Retain", dir)
			}
			// What an admin does to let it go: deleting the content leaves the directory too.
			snaps.SnapshotV1().VolumeSnapshotContents().Delete(ctx, content.Name, metav1.DeleteOptions{})
		})
	}
}

// restoreOf makes the claim a restore of the VolumeSnapshot name.
func restoreOf(name string) framework.ClaimOption {
	group := snapshotv1.GroupName
	return func(c *v1.PersistentVolumeClaim) {
		c.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: &group, Kind: "VolumeSnapshot", Name: name}
	}
}

// A user snapshots a claim holding every kind of entry, keeps writing to it, and restores the
// snapshot into a new claim: the VolumeSnapshot's restoreSize is the source's capacity, the
// snapshot's tree is the source's as it was, the restored claim binds with that tree (not
// what was written after) and the symlink's target outside is left alone, and a restore
// asking for less than the restoreSize is refused with an event. A local claim's snapshot is
// its node's (the content labelled for it) and is restored on that node; an NFS claim's (on
// the bind-mounted export) is the controller's, its content labelled for no node.
func TestSnapshotRestore(t *testing.T) {
	for _, b := range lifecycleBackends() {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			ns := suite.NewNamespace(t)
			class, _ := b.class(t, nil)
			claim := func(name string, opts ...framework.ClaimOption) {
				suite.CreateClaim(t, ns, name, class, append(slices.Clone(b.claim), opts...)...)
			}
			node := map[string]string{"local": nodeA}[b.name]
			vsClass := snapshotClass(t, snapshotv1.VolumeSnapshotContentDelete)
			claim("src", framework.Request("1Gi"))
			_, srcPV := waitBound(t, ns, "src")
			outside, before := outsideDir(t)
			writeTree(t, volumeDir(srcPV), outside)

			vs, content := takeSnapshot(t, ns, "snap", "src", vsClass)
			if vs.Status.RestoreSize == nil || vs.Status.RestoreSize.Cmp(srcPV.Spec.Capacity[v1.ResourceStorage]) != 0 {
				t.Errorf("restoreSize %v, want the source's capacity", vs.Status.RestoreSize)
			}
			if got := content.Labels["snapshot.storage.kubernetes.io/managed-by"]; got != node {
				t.Errorf("content managed-by label %q, want %q", got, node)
			}
			snapDir := snapshotDir(t, content)
			checkSameTree(t, volumeDir(srcPV), snapDir)
			must(t, os.WriteFile(filepath.Join(volumeDir(srcPV), "written-after"), []byte("later"), 0o644))

			claim("small", framework.Request("500Mi"), restoreOf("snap"))
			if _, err := framework.WaitForEvent(ctx, suite.Client, ns, "PersistentVolumeClaim", "small", "ProvisioningFailed", "request at least 1Gi", timeout); err != nil {
				t.Errorf("restore smaller than the snapshot: %v", err)
			}

			claim("restored", framework.Request("1Gi"), restoreOf("snap"))
			_, pv := waitBound(t, ns, "restored")
			checkSameTree(t, snapDir, volumeDir(pv))
			if exists(t, filepath.Join(volumeDir(pv), "written-after")) {
				t.Error("the restore holds a file written after the snapshot was taken")
			}
			if d := framework.DiffSnapshots(before, snapshotTree(t, outside, nil)); len(d) > 0 {
				t.Errorf("snapshot or restore changed the symlink's target outside the volume:\n%s", strings.Join(d, "\n"))
			}
			if pv.Annotations["dirpv.io/node"] != node {
				t.Errorf("restored PV on node %q, want the snapshot's %q", pv.Annotations["dirpv.io/node"], node)
			}
		})
	}
}

// writeNumbered writes files 000000, 000001, ... into dir, in order, each fileSize bytes of
// its own number and fsynced before the next is made (as a database commits), until ctx is
// done or maxWrites are written, counting them in written.
func writeNumbered(ctx context.Context, dir string, written *atomic.Int64, done chan<- struct{}) {
	defer close(done)
	for i := 0; i < maxWrites && ctx.Err() == nil; i++ {
		f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("%06d", i)), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return
		}
		_, err = f.Write(numbered(i))
		if err == nil {
			err = f.Sync()
		}
		if f.Close() != nil || err != nil {
			return
		}
		written.Store(int64(i + 1))
	}
}

// maxWrites bounds the writer, whose disk is the host's.
const maxWrites = 20000

const fileSize = 16 << 10

func numbered(i int) []byte { return bytes.Repeat([]byte(fmt.Sprintf("%06d\n", i)), fileSize/7) }

// restoredWrites says what a restore of writeNumbered's directory holds: how many numbered
// files, whether they are 0..n-1 (a prefix of the writes), and how many are not whole.
func restoredWrites(t *testing.T, dir string) (n int, prefix bool, torn int) {
	t.Helper()
	prefix = true
	for i, name := range entries(t, dir) {
		if name != fmt.Sprintf("%06d", i) {
			prefix = false
		}
		var k int
		if _, err := fmt.Sscanf(name, "%06d", &k); err != nil {
			continue
		}
		n++
		if b, err := os.ReadFile(filepath.Join(dir, name)); err != nil || !bytes.Equal(b, numbered(k)) {
			torn++
		} else if torn > 0 {
			// A whole file after one that is not: no moment of the writer's.
			prefix = false
		}
	}
	return n, prefix, torn
}

// snapshotWhileWriting snapshots a claim of class while a writer adds numbered files to it,
// restores the snapshot, and returns the restored directory and the snapshot's method.
func snapshotWhileWriting(t *testing.T, ns, class string) (string, string) {
	t.Helper()
	ctx := context.Background()
	vsClass := snapshotClass(t, snapshotv1.VolumeSnapshotContentDelete)
	suite.CreateClaim(t, ns, "src", class, framework.OnNode(nodeA), framework.Request("200Mi"))
	_, srcPV := waitBound(t, ns, "src")
	writing, stop := context.WithCancel(ctx)
	defer stop()
	var written atomic.Int64
	done := make(chan struct{})
	go writeNumbered(writing, volumeDir(srcPV), &written, done)
	// Snapshot once the writer is well under way.
	err := framework.Poll(ctx, timeout, func(context.Context) (bool, error) { return written.Load() >= 300, nil })
	if err != nil {
		t.Fatalf("writer: %d files: %v", written.Load(), err)
	}
	_, content := takeSnapshot(t, ns, "snap", "src", vsClass)
	stop()
	<-done
	total := written.Load()
	info, err := os.ReadFile(filepath.Join(filepath.Dir(snapshotDir(t, content)), "info.json"))
	must(t, err)
	var meta struct{ Method string }
	must(t, json.Unmarshal(info, &meta))
	suite.CreateClaim(t, ns, "restored", class, framework.OnNode(nodeA), framework.Request("200Mi"), restoreOf("snap"))
	_, pv := waitBound(t, ns, "restored")
	t.Logf("writer wrote %d files in all; snapshot method %s", total, meta.Method)
	return volumeDir(pv), meta.Method
}

// A snapshot of a volume on btrfs with quota (a subvolume) is a read-only btrfs snapshot: a
// writer writing numbered files in order meanwhile, each fsynced, the restore holds exactly
// the files 0..n-1 for some n, each whole but perhaps the last: one point in time. (Without
// the fsync, the last few files written before the snapshot came out empty or short, as
// after a crash: observed 7 of 914 in one run, all after the whole ones.)
func TestSnapshotWhileWritingBtrfsIsPointInTime(t *testing.T) {
	ns := suite.NewNamespace(t)
	base := filepath.Join(suite.Work.BaseRoot, "btrfs-snapshot")
	must(t, os.MkdirAll(base, 0o755))
	must(t, suite.MountBtrfs(base, 1<<30, true))
	class := suite.CreateClass(t, "btrfs-snapshot", map[string]string{"backend": "local", "basePath": base})
	dir, method := snapshotWhileWriting(t, ns, class.Name)
	if method != volume.MethodBtrfsSnapshot {
		t.Fatalf("snapshot method %q, want %q", method, volume.MethodBtrfsSnapshot)
	}
	n, prefix, torn := restoredWrites(t, dir)
	t.Logf("btrfs: restore holds %d numbered files, prefix %v, %d not whole", n, prefix, torn)
	if n < 300 || !prefix || torn > 1 {
		t.Errorf("restore holds %d files (prefix %v, %d not whole): want a prefix of at least 300 files, at most the last one cut", n, prefix, torn)
	}
}

// The same on a plain directory (the suite's base: no btrfs subvolume), where the snapshot is
// a copy made entry by entry: what it holds is logged for docs/clones-and-snapshots.md; the
// test only checks that the restore binds and holds files the writer wrote.
func TestSnapshotWhileWritingPlainCopy(t *testing.T) {
	ns := suite.NewNamespace(t)
	class, _ := localClass(t, nil)
	dir, method := snapshotWhileWriting(t, ns, class.Name)
	n, prefix, torn := restoredWrites(t, dir)
	t.Logf("plain copy (%s): restore holds %d numbered files, prefix of the writes %v, %d not whole", method, n, prefix, torn)
	if n == 0 {
		t.Error("restore holds none of the files written before the snapshot")
	}
}

// A long copy tells the user how it goes, on the objects they watch. A snapshot's copy, held
// halfway (failpoint.PauseDuringCopy): a CopyStarted event on the VolumeSnapshot, its content
// and the source claim, then a CopyProgress event saying what it copied so far (30 s in); the
// snapshot is ready once the copy goes on. (A clone's CopyStarted event:
// TestCloneLargeTreeInBackground.)
func TestLongCopiesReportProgress(t *testing.T) {
	const (
		files = 200
		point = failpoint.PauseDuringCopy
	)
	release := filepath.Join(t.TempDir(), "release")
	proc, ns, _, _ := sourceStoppedAt(t, uniqueName("node-copy-progress"), point, files, failpoint.ReleaseEnv+"="+release)
	vs := createSnapshot(t, ns, "snap", "src", snapshotClass(t, snapshotv1.VolumeSnapshotContentDelete))
	waitHeldAt(t, proc, point)
	content := "snapcontent-" + string(vs.UID)
	want := "into snapshot snapshot-" + string(vs.UID)
	waitEvent(t, ns, "VolumeSnapshot", "snap", provisioner.ReasonCopyStarted, want, proc)
	waitEvent(t, metav1.NamespaceDefault, "VolumeSnapshotContent", content, provisioner.ReasonCopyStarted, want, proc)
	waitEvent(t, ns, "PersistentVolumeClaim", "src", provisioner.ReasonCopyStarted, want, proc)
	e := waitEvent(t, ns, "VolumeSnapshot", "snap", provisioner.ReasonCopyProgress, "files so far", proc)
	if !regexp.MustCompile(`copied [0-9.]+ (B|KiB|MiB) in [0-9,]+ files so far`).MatchString(e.Message) || e.Type != v1.EventTypeNormal {
		t.Errorf("progress event %s %q, want a Normal one saying what was copied", e.Type, e.Message)
	}
	must(t, os.WriteFile(release, nil, 0o644))
	waitSnapshotReady(t, ns, "snap")
}
