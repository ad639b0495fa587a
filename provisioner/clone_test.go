package provisioner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
)

// A quick copy is returned by the call that starts it, and nobody is told again. A copy that
// outlasts the inline wait goes on in the background: the first call gets no job, the job
// calls done once it ends, and the next call gets its result, once.
func TestCopyJobsBackground(t *testing.T) {
	j := newCopyJobs()
	job, err := j.run(context.Background(), "quick", "src", time.Minute, func(context.Context) (made, error) {
		return made{quota: "btrfs/1"}, nil
	}, func(made, error, time.Duration) { t.Error("done called for a copy its caller waited for") }, nil)
	if err != nil || job == nil || job.result.quota != "btrfs/1" {
		t.Fatalf("quick copy: job %+v, %v", job, err)
	}
	j.inline = 10 * time.Millisecond
	release := make(chan struct{})
	noted := make(chan error, 1)
	fn := func(ctx context.Context) (made, error) {
		<-release
		return made{created: true}, nil
	}
	done := func(_ made, err error, _ time.Duration) { noted <- err }
	job, err = j.run(context.Background(), "uid", "src", time.Minute, fn, done, nil)
	if job != nil || err != nil {
		t.Fatalf("first call: job %v, %v; want none while the copy runs", job, err)
	}
	// A second call while it runs starts nothing new.
	if job, err := j.run(context.Background(), "uid", "src", time.Minute, func(context.Context) (made, error) {
		t.Error("a second copy started for the same claim")
		return made{}, nil
	}, done, nil); job != nil || err != nil {
		t.Fatalf("second call: job %v, %v", job, err)
	}
	close(release)
	select {
	case err := <-noted:
		if err != nil {
			t.Fatalf("done got %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("done was not called once the background copy ended")
	}
	job, err = j.run(context.Background(), "uid", "src", time.Minute, fn, done, nil)
	if err != nil || job == nil || !job.result.created {
		t.Fatalf("call after the copy: job %+v, %v; want its result", job, err)
	}
	if len(j.byUID) != 0 {
		t.Errorf("jobs left after the result was taken: %v", j.byUID)
	}
	if !j.stop(time.Second) {
		t.Error("stop did not return in time")
	}
}

// A copy past its deadline fails with an error naming --clone-timeout; stop cancels copies
// under way and refuses new ones.
func TestCopyJobsDeadlineAndStop(t *testing.T) {
	j := newCopyJobs()
	wait := func(ctx context.Context) (made, error) {
		<-ctx.Done()
		return made{}, ctx.Err()
	}
	job, err := j.run(context.Background(), "late", "src", 5*time.Millisecond, wait, func(made, error, time.Duration) {}, nil)
	if err != nil || job == nil || !errors.Is(job.err, context.DeadlineExceeded) || !strings.Contains(job.err.Error(), "--clone-timeout") {
		t.Fatalf("job %+v, %v; want a deadline error naming --clone-timeout", job, err)
	}
	j.inline = time.Millisecond
	if job, err := j.run(context.Background(), types.UID("long"), "src", time.Hour, wait, func(made, error, time.Duration) {}, nil); job != nil || err != nil {
		t.Fatalf("long copy: job %v, %v", job, err)
	}
	if !j.stop(10 * time.Second) {
		t.Fatal("stop did not end the copy under way")
	}
	if _, err := j.run(context.Background(), "new", "src", time.Hour, wait, nil, nil); !errors.Is(err, errCopyStopped) {
		t.Errorf("copy after stop: %v, want errCopyStopped", err)
	}
}

// A source PV pointing at a directory another claim's marker names is refused.
func TestCheckSourceOwner(t *testing.T) {
	root, err := volume.OpenRoot(t.TempDir())
	must(t, err)
	defer root.Close()
	_, err = root.MkdirAll("vol", volume.Owner{Mode: 0o755, UID: -1, GID: -1}, volume.Claim{UID: "mine", PVName: "pv-mine"})
	must(t, err)
	src := func(uid string) *sourceTree {
		return &sourceTree{what: "source", attrs: volume.Attributes{Path: "vol"}, owner: &volume.Claim{UID: uid}}
	}
	if err := checkSourceOwner(root, src("mine")); err != nil {
		t.Errorf("the source's own directory: %v", err)
	}
	if err := checkSourceOwner(root, src("theirs")); err == nil || !strings.Contains(err.Error(), "belongs to another claim") {
		t.Errorf("another claim's directory: %v, want a refusal", err)
	}
}

// sourceClaim provisions the Bound local claim name, with a volume of the given capacity,
// and fills its directory with fill; it returns the claim.
func (f *fixture) sourceClaim(t *testing.T, class *storagev1.StorageClass, name, capacity string, fill func(dir string)) *v1.PersistentVolumeClaim {
	t.Helper()
	pvc := claim(name)
	pvc.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse(capacity)
	pv, _, err := f.node.Provision(context.Background(), opts(class, pvc))
	must(t, err)
	fill(filepath.Join(f.base, pv.Spec.CSI.VolumeAttributes["path"]))
	pv.Spec.Capacity = v1.ResourceList{v1.ResourceStorage: resource.MustParse(capacity)}
	pv.Spec.ClaimRef = &v1.ObjectReference{Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID}
	pvc.Spec.VolumeName, pvc.Status.Phase = pv.Name, v1.ClaimBound
	client := f.node.cfg.Client
	_, err = client.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{})
	must(t, err)
	_, err = client.CoreV1().PersistentVolumeClaims(pvc.Namespace).Create(context.Background(), pvc, metav1.CreateOptions{})
	must(t, err)
	return pvc
}

// cloneOf returns a claim copying src, created in the API.
func (f *fixture) cloneOf(t *testing.T, class *storagev1.StorageClass, name string, src *v1.PersistentVolumeClaim) controller.ProvisionOptions {
	t.Helper()
	pvc := claim(name)
	pvc.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: kindPVC, Name: src.Name}
	o := opts(class, pvc)
	_, err := f.node.cfg.Client.CoreV1().PersistentVolumeClaims(pvc.Namespace).Create(context.Background(), pvc, metav1.CreateOptions{})
	must(t, err)
	return o
}

func fillFiles(n int) func(dir string) {
	return func(dir string) {
		for i := range n {
			os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), []byte("data"), 0o600)
		}
	}
}

// onlySource waits until the base holds the source's volume alone: no copy, finished or
// half-made, and no job for the clone.
func (f *fixture) onlySource(t *testing.T, src *v1.PersistentVolumeClaim, clone types.UID) {
	t.Helper()
	pv, err := f.node.cfg.Client.CoreV1().PersistentVolumes().Get(context.Background(), src.Spec.VolumeName, metav1.GetOptions{})
	must(t, err)
	prefix := pv.Spec.CSI.VolumeAttributes["path"]
	eventually(t, 10*time.Second, func() (bool, string) {
		for _, e := range listTree(t, f.base) {
			if !strings.HasPrefix(e, prefix) {
				return false, fmt.Sprintf("the clone left %s on disk", e)
			}
		}
		if f.node.copies.running(clone) {
			return false, "the clone's copy job is still there"
		}
		return true, ""
	})
}

// A source deleted while its copy runs in the background makes the lib give up the claim:
// the copy is cancelled, or its finished volume removed, since no PV will name it.
func TestCloneOfDeletedSourceLeavesNothing(t *testing.T) {
	f := newFixture(t)
	class := f.localClass(nil)
	src := f.sourceClaim(t, class, "src", "1Gi", fillFiles(2000))
	f.node.copies.inline = time.Nanosecond
	o := f.cloneOf(t, class, "clone", src)
	if _, state, err := f.node.Provision(context.Background(), o); state != controller.ProvisioningInBackground {
		t.Fatalf("first call: %s, %v; want the copy in the background", state, err)
	}
	must(t, f.node.cfg.Client.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), src.Name, metav1.DeleteOptions{}))
	_, state, err := f.node.Provision(context.Background(), o)
	if state != controller.ProvisioningFinished || err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Fatalf("call after the source went: %s, %v; want a final error naming the missing source", state, err)
	}
	f.onlySource(t, src, o.PVC.UID)
}

// A claim deleted while its copy runs gets no volume: the copy is removed once done.
func TestCloneOfDeletedClaimLeavesNothing(t *testing.T) {
	f := newFixture(t)
	class := f.localClass(nil)
	src := f.sourceClaim(t, class, "src", "1Gi", fillFiles(10))
	o := f.cloneOf(t, class, "clone", src)
	// Deleted before the copy ends: whether it ends inline or not, its claim is gone by then.
	must(t, f.node.cfg.Client.CoreV1().PersistentVolumeClaims("ns").Delete(context.Background(), o.PVC.Name, metav1.DeleteOptions{}))
	if pv, _, err := f.node.Provision(context.Background(), o); pv != nil {
		t.Fatalf("Provision returned a PV for a deleted claim (%v)", err)
	}
	f.onlySource(t, src, o.PVC.UID)
}

// A copy the base has not the free space for is not started: it would fill the base for every
// volume on it, and the retry would fill it again. The claim is told why with an event of its
// own, nothing is written, the claim is not refused for good, and once space is freed the
// next retry makes the copy.
func TestCloneWithoutRoomWaits(t *testing.T) {
	f := newFixtureOn(t, tmpfs(t, "size=12m")) // a base that a few MiB fill
	class := f.localClass(nil)
	var srcDir string
	src := f.sourceClaim(t, class, "src", "1Mi", func(dir string) {
		srcDir = dir
		must(t, os.WriteFile(filepath.Join(dir, "big"), make([]byte, 8<<20), 0o600))
	})
	o := f.cloneOf(t, class, "clone", src)
	o.PVC.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("1Mi")
	provision := func() (*v1.PersistentVolume, controller.ProvisioningState, error) {
		var (
			pv    *v1.PersistentVolume
			state controller.ProvisioningState
			err   error
		)
		eventually(t, 30*time.Second, func() (bool, string) {
			pv, state, err = f.node.Provision(context.Background(), o)
			return state != controller.ProvisioningInBackground, "the copy is still running"
		})
		return pv, state, err
	}
	_, state, err := provision()
	if state != controller.ProvisioningFinished || err == nil || status.Code(err) == codes.InvalidArgument ||
		!errors.Is(err, volume.ErrNoRoomForCopy) {
		t.Fatalf("Provision = %s, %v; want an error saying there is no room for the copy, to be retried", state, err)
	}
	waitEvent(t, f.events, "Warning "+ReasonNoRoomForCopy+" ")
	f.onlySource(t, src, o.PVC.UID)

	// Space is freed: the next retry copies.
	must(t, os.Truncate(filepath.Join(srcDir, "big"), 1<<20))
	pv, state, err := provision()
	if err != nil || pv == nil || state != controller.ProvisioningFinished {
		t.Fatalf("Provision once there is room = %v, %s, %v; want the clone's PV", pv, state, err)
	}
}

// tmpfs mounts a tmpfs with the given options, for the test's lifetime, as a base.
func tmpfs(t *testing.T, options string) string {
	t.Helper()
	base := t.TempDir()
	if err := unix.Mount("tmpfs", base, "tmpfs", 0, options); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(base, unix.MNT_DETACH) })
	return base
}
