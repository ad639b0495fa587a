package provisioner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
	"github.com/dirpv/dirpv/volume/export/exporttest"
)

// eventually polls until a condition holds (exporttest.Eventually).
var eventually = exporttest.Eventually

// trashFixture is a controller Provisioner on a stand-in NFS export (a tmpfs, bind-mounted by
// exporttest.BindMounter as the controller's mount), with a class on it.
type trashFixture struct {
	m       *exporttest.BindMounter
	src     string
	work    string
	class   *storagev1.StorageClass
	lister  storagelisters.StorageClassLister
	timeout time.Duration
}

func newTrashFixture(t *testing.T, timeout time.Duration) *trashFixture {
	t.Helper()
	f := &trashFixture{m: exporttest.NewBindMounter(t), work: t.TempDir(), timeout: timeout}
	f.src = f.m.Export(t, "nfs.example", "/export")
	// tmpfs keeps 100k files off the shared disk.
	must(t, unix.Mount("tmpfs", f.src, "tmpfs", 0, "size=512m"))
	t.Cleanup(func() { unix.Unmount(f.src, unix.MNT_DETACH) })
	f.class = &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "nfs"}, Provisioner: testDriver,
		Parameters: map[string]string{"backend": "nfs", "server": "nfs.example", "share": "/export"}}
	classes := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	classes.Add(f.class)
	f.lister = storagelisters.NewStorageClassLister(classes)
	return f
}

// start runs a controller Provisioner, as after a (re)start of dirpv controller.
func (f *trashFixture) start(t *testing.T) *Provisioner {
	t.Helper()
	p, err := New(Config{DriverName: testDriver, Role: RoleController, Client: fake.NewClientset(), Classes: f.lister,
		Mounter: f.m, WorkDir: f.work, OperationTimeout: f.timeout})
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return p
}

func (f *trashFixture) provision(t *testing.T, p *Provisioner, name string) *v1.PersistentVolume {
	t.Helper()
	c := claim(name, v1.ReadWriteMany)
	delete(c.Annotations, annSelectedNode)
	pv, _, err := p.Provision(context.Background(), opts(f.class, c))
	if err != nil {
		t.Fatalf("provision %s: %v", name, err)
	}
	return pv
}

func (f *trashFixture) trashEntries(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(f.src, export.TrashDir))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// waitTrashEmpty waits until p has removed every tree in the export's trash.
func (f *trashFixture) waitTrashEmpty(t *testing.T, p *Provisioner, within time.Duration) {
	t.Helper()
	eventually(t, within, func() (bool, string) {
		got := f.trashEntries(t)
		return len(got) == 0 && p.PendingDeletes() == 0, fmt.Sprintf("trash %v, %d pending", got, p.PendingDeletes())
	})
}

// Deleting a big NFS volume, or a snapshot of one, or discarding a copy made for a claim
// deleted meanwhile, returns within the operation timeout though removing the tree takes
// longer: it leaves its name at once, its tree goes to the export's trash, other claims on the
// export are served meanwhile, also while a step of the walk outlasts the timeout, a retried
// delete (the lib's, the snapshot sidecar's) starts no second walk, the trash ends empty, and
// the export is never taken for dead (mounted once throughout).
func TestLargeNFSDeleteReturnsAtOnce(t *testing.T) {
	const timeout = 2 * time.Second
	// trashed says what is wrong if pv's directory is not gone from its name into the trash.
	trashed := func(t *testing.T, f *trashFixture, pv *v1.PersistentVolume) func() error {
		return func() error {
			if _, err := os.Lstat(filepath.Join(f.src, pv.Spec.CSI.VolumeAttributes["path"])); !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("volume directory: %v", err)
			}
			if got := f.trashEntries(t); len(got) != 1 || got[0] != pv.Name {
				return fmt.Errorf("trash %v, want [%s]", got, pv.Name)
			}
			return nil
		}
	}
	for _, tc := range []struct {
		name  string
		files int
		// prepare returns how to delete what the test deletes, and what is wrong if that is
		// not gone from its name.
		prepare func(t *testing.T, f *trashFixture, p *Provisioner, pv *v1.PersistentVolume) (del func() error, notGone func() error)
	}{
		{"volume", 100_000, func(t *testing.T, f *trashFixture, p *Provisioner, pv *v1.PersistentVolume) (func() error, func() error) {
			return func() error { return p.Delete(context.Background(), pv) }, trashed(t, f, pv)
		}},
		// A copy made for a claim that was deleted meanwhile: discarded as a deleted volume is.
		{"discarded copy", 20_000, func(t *testing.T, f *trashFixture, p *Provisioner, pv *v1.PersistentVolume) (func() error, func() error) {
			attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
			must(t, err)
			return func() error {
				p.discardVolume(klog.Background(), attrs, nil, claimOf(pv), made{created: true})
				return nil
			}, trashed(t, f, pv)
		}},
		{"snapshot", 20_000, func(t *testing.T, f *trashFixture, p *Provisioner, pv *v1.PersistentVolume) (func() error, func() error) {
			s := startSnapshotter(t, p, pv)
			id, _ := createUntilReady(t, s, "snapshot-big", pv.Spec.CSI.VolumeHandle)
			return func() error { return s.DeleteSnapshot(context.Background(), id, nil) }, func() error {
				if ready, _, _, _, err := s.GetSnapshotStatus(context.Background(), id, nil); err == nil || ready {
					return fmt.Errorf("snapshot status: ready %v, err %v", ready, err)
				}
				return nil
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newTrashFixture(t, timeout)
			p := f.start(t)
			pv := f.provision(t, p, "big")
			must(t, framework.FillEmptyFiles(filepath.Join(f.src, pv.Spec.CSI.VolumeAttributes["path"]), tc.files))
			del, notGone := tc.prepare(t, f, p, pv)

			// Hold the walk, so that it outlasts the operation timeout whatever the machine's speed.
			release := make(chan struct{})
			p.exports.HoldSteps(func() { <-release })
			start := time.Now()
			must(t, del())
			if d := time.Since(start); d >= timeout {
				t.Errorf("the delete took %v, operation timeout %v", d, timeout)
			}
			if err := notGone(); err != nil {
				t.Errorf("after the delete: %v; want it gone from its name, its tree in the trash", err)
			}
			if got, n := f.trashEntries(t), p.PendingDeletes(); len(got) != 1 || n != 1 {
				t.Errorf("trash %v, %d pending deletes; want one tree, removed in the background", got, n)
			}
			// The export keeps serving claims while the tree waits for its removal.
			f.provision(t, p, "meanwhile")
			// The walk runs on a goroutine of its own: wait until it has started (and is held),
			// so that a second walk, if the retry below started one, could not be mistaken for
			// the first.
			eventually(t, 30*time.Second, func() (bool, string) {
				n := p.exports.RemovalsStarted()
				return n == 1, fmt.Sprintf("%d removals started, want 1", n)
			})
			// A delete whose result the caller did not see is retried: no second walk.
			must(t, del())
			if removals := p.exports.RemovalsStarted(); removals != 1 || p.PendingDeletes() != 1 {
				t.Errorf("after a second delete: %d removals started and %d pending, want 1 and 1", removals, p.PendingDeletes())
			}
			// The held step outlasts the operation timeout, as on a server that stopped
			// answering: the walk pauses, and the export still serves claims.
			<-time.After(time.Until(start.Add(timeout + timeout/2)))
			f.provision(t, p, "while-paused")
			close(release)

			f.waitTrashEmpty(t, p, 2*time.Minute)
			t.Logf("%d files removed %v after the delete returned", tc.files, time.Since(start).Round(time.Millisecond))
			if n := f.m.Mounts.Load(); n != 1 {
				t.Errorf("export mounted %d times, want once: the walk must not make it look dead", n)
			}
		})
	}
}

// A trash entry left by a controller that stopped mid-walk is removed by the next one, on its
// first use of the export.
func TestTrashResumedAfterRestart(t *testing.T) {
	const timeout = 2 * time.Second
	f := newTrashFixture(t, timeout)
	first := f.start(t)
	pv := f.provision(t, first, "old")
	must(t, framework.FillEmptyFiles(filepath.Join(f.src, pv.Spec.CSI.VolumeAttributes["path"]), 3000))
	// The first controller's walk never gets going: it stops for shutdown instead.
	first.exports.HoldSteps(func() { <-first.exports.ShuttingDown() })
	must(t, first.Delete(context.Background(), pv))
	first.exports.Close(context.Background())
	if got := f.trashEntries(t); len(got) != 1 {
		t.Fatalf("trash after the first controller stopped: %v, want the deleted volume", got)
	}

	second := f.start(t)
	f.provision(t, second, "new")
	f.waitTrashEmpty(t, second, time.Minute)
}
