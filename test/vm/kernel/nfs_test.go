package kernel

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
)

// TestDeadServerHardMount: with the server dead under a hard mount (rpc.nfsd 0 after the
// controller and a pod mounted the export), Provision and Delete return an error within the
// controller's --operation-timeout instead of hanging in the kernel; the calls left waiting
// in the kernel stay at the export's cap however many come; NodeUnpublishVolume of the dead
// mount returns within its deadline and leaves no mount, and the node plugin serves other
// volumes meanwhile. Once nfsd is back, the work left over completes without a restart.
func TestDeadServerHardMount(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	options := []string{"nfsvers=4.2", "hard"}
	serverDir, share := exportFor(t, options, guest.NoRootSquash)
	const opTimeout = 10 * time.Second
	f := newController(t, opTimeout)
	class := f.nfsClass("nfs", share, options, nil)
	pv, err := f.provision(ctx, class, "before")
	must(t, err)
	const nodeTimeout = 20 * time.Second
	node := nodePlugin(t, nodeTimeout)
	target := filepath.Join(t.TempDir(), "target")
	if _, err := node.NodePublishVolume(ctx, publishRequest(pv, target, false)); err != nil {
		t.Fatal(err)
	}
	must(t, os.WriteFile(filepath.Join(target, "data"), []byte("x"), 0o644))

	srv := nfsServer(t)
	must(t, srv.Kill(ctx))
	resumed := false
	t.Cleanup(func() { // before the controller's and the export's cleanups
		if !resumed {
			if err := srv.Resume(context.Background()); err != nil {
				t.Errorf("restarting nfsd: %v", err)
			}
		}
	})
	source := guest.NFSAddr + ":" + share
	stop := watchExport(t, f, source)
	defer stop()

	// The lib calls Provision and Delete with no deadline of their own: dirpv's bounds them.
	// More calls than the cap at once, as the lib's workers and retries make them.
	const slack = 5 * time.Second
	type result struct {
		err  error
		took time.Duration
	}
	results := make([]result, 2*stuckCap)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			start := time.Now()
			_, err := f.provision(ctx, class, fmt.Sprintf("during-%d", i))
			results[i] = result{err, time.Since(start)}
		})
	}
	wg.Wait()
	for i, r := range results {
		if r.err == nil {
			t.Errorf("Provision #%d on a dead server succeeded", i)
		}
		if r.took > opTimeout+slack {
			t.Errorf("Provision #%d on a dead server took %v, operation timeout %v (%v)", i, r.took, opTimeout, r.err)
		}
	}
	t.Logf("Provision on a dead server: %v", results[0].err)
	// The cap is reached and held: every slot taken by a call its caller gave up on. (The
	// forced unmount that follows the timeouts aborts those calls about an operation timeout
	// later; the watch checks that the count never goes past the cap meanwhile.)
	status := func() provisioner.ExportStatus {
		for _, st := range f.p.Exports() {
			if st.Export == source {
				return st
			}
		}
		return provisioner.ExportStatus{}
	}
	if err := framework.Poll(ctx, opTimeout/2, func(context.Context) (bool, error) {
		st := status()
		return st.Stuck == stuckCap && st.Saturated, fmt.Errorf("%+v", st)
	}); err != nil {
		t.Errorf("stuck calls on %s did not reach the cap of %d: %v", source, stuckCap, err)
	} else {
		hold := time.NewTicker(time.Second)
		for i := range 3 {
			<-hold.C
			if st := status(); st.Stuck != stuckCap || !st.Saturated {
				t.Errorf("poll %d after the cap was reached: stuck %d, saturated %t; want %d, true", i+1, st.Stuck, st.Saturated, stuckCap)
			}
		}
		hold.Stop()
	}
	start := time.Now()
	if err := f.p.Delete(ctx, pv); err == nil {
		t.Error("Delete on a dead server succeeded")
	} else {
		t.Logf("Delete on a dead server: %v after %v", err, time.Since(start))
	}
	if took := time.Since(start); took > opTimeout+slack {
		t.Errorf("Delete on a dead server took %v, operation timeout %v", took, opTimeout)
	}
	if most := stop(); most > stuckCap {
		t.Errorf("stuck calls on %s reached %d, above the cap of %d", source, most, stuckCap)
	}

	// kubelet gives a CSI call two minutes; the plugin's own budget is a plain unmount, a
	// forced one and a lazy one, each bounded.
	const unpublishDeadline = 2 * time.Minute
	nfsDone := make(chan result, 1)
	go func() {
		uctx, ucancel := context.WithTimeout(ctx, unpublishDeadline)
		defer ucancel()
		start := time.Now()
		_, err := node.NodeUnpublishVolume(uctx, &csi.NodeUnpublishVolumeRequest{VolumeId: pv.Spec.CSI.VolumeHandle, TargetPath: target})
		nfsDone <- result{err, time.Since(start)}
	}()
	// Meanwhile a pod of a local volume comes and goes on the same plugin.
	local := node.localPV(t, "local")
	localTarget := filepath.Join(t.TempDir(), "local-target")
	req := publishRequest(local, localTarget, false)
	req.VolumeCapability.AccessMode.Mode = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	start = time.Now()
	if _, err := node.NodePublishVolume(ctx, req); err != nil {
		t.Errorf("NodePublishVolume of a local volume while an NFS unmount hangs: %v", err)
	}
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: local.Spec.CSI.VolumeHandle, TargetPath: localTarget}); err != nil {
		t.Errorf("NodeUnpublishVolume of a local volume while an NFS unmount hangs: %v", err)
	}
	localTook := time.Since(start)
	select {
	case u := <-nfsDone:
		t.Errorf("the NFS unpublish returned (%v after %v) before the local volume's publish and unpublish (%v): nothing shows they ran while it hung", u.err, u.took, localTook)
		nfsDone <- u
	default:
		t.Logf("local volume published and unpublished in %v while the NFS unpublish was under way", localTook)
	}
	u := <-nfsDone
	t.Logf("NodeUnpublishVolume of the dead mount: %v after %v", u.err, u.took)
	if u.err != nil {
		t.Errorf("NodeUnpublishVolume of a dead hard mount: %v", u.err)
	}
	if u.took > 3*nodeTimeout {
		t.Errorf("NodeUnpublishVolume took %v, operation timeout %v", u.took, nodeTimeout)
	}
	if left, err := framework.MountsUnder(target); err != nil || len(left) > 0 {
		t.Errorf("dead mount still at the target: %v (%v)", left, err)
	}

	// The server is back: the same calls, retried as the lib retries them, succeed.
	must(t, srv.Resume(ctx))
	resumed = true
	var retried *v1.PersistentVolume
	if err := framework.Poll(ctx, 3*time.Minute, func(ctx context.Context) (bool, error) {
		var err error
		retried, err = f.provision(ctx, class, "during-0")
		return err == nil, err
	}); err != nil {
		t.Fatalf("Provision retried after nfsd came back: %v", err)
	}
	if st, err := os.Lstat(filepath.Join(serverDir, retried.Spec.CSI.VolumeAttributes["path"])); err != nil || !st.IsDir() {
		t.Errorf("retried volume's directory on the server: %v", err)
	}
	if err := framework.Poll(ctx, 2*time.Minute, func(ctx context.Context) (bool, error) {
		err := f.p.Delete(ctx, pv)
		return err == nil, err
	}); err != nil {
		t.Fatalf("Delete retried after nfsd came back: %v", err)
	}
	if err := framework.Poll(ctx, 2*time.Minute, func(context.Context) (bool, error) {
		n := f.p.PendingDeletes()
		return n == 0, fmt.Errorf("%d deletes pending", n)
	}); err != nil {
		t.Errorf("background deletes after nfsd came back: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(serverDir, pv.Spec.CSI.VolumeAttributes["path"])); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("deleted volume still on the server: %v", err)
	}
	if trash, _ := os.ReadDir(filepath.Join(serverDir, ".dirpv-trash")); len(trash) > 0 {
		t.Errorf("trash left on the server: %v", trash)
	}
}

// stuckCap is provisioner's maxStuckCalls: calls that may wait on one export at once.
const stuckCap = 8

// watchExport logs every change of the export's status in f.Exports() until stop, which
// returns the most stuck calls seen.
func watchExport(t *testing.T, f *controllerFixture, source string) (stop func() (most int)) {
	done := make(chan struct{})
	most := 0
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		start := time.Now()
		var last provisioner.ExportStatus
		for {
			for _, st := range f.p.Exports() {
				if st.Export == source && (st.Stuck != last.Stuck || st.Saturated != last.Saturated) {
					t.Logf("%6.1fs export %s: stuck %d, saturated %t", time.Since(start).Seconds(), source, st.Stuck, st.Saturated)
					last = st
					most = max(most, st.Stuck)
				}
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	var once sync.Once
	return func() int {
		once.Do(func() { close(done); <-finished })
		return most
	}
}

// TestRootSquash: on a kernel export with root_squash the controller's root is the anonymous
// user on the server, who may create directories in the world-writable export but not give
// them away. A class with uid/gid fails with the error that names root_squash, as often as it
// is retried, and leaves nothing on the server; a class without them works.
func TestRootSquash(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	options := []string{"nfsvers=4.2"}
	serverDir, share := exportFor(t, options, guest.RootSquash)
	f := newController(t, time.Minute)
	owned := f.nfsClass("owned", share, options, map[string]string{"uid": "1001", "gid": "2002"})
	var err error
	for i := range 2 { // the lib retries a failed claim: the retry must not adopt a leftover
		if _, err = f.provision(ctx, owned, "c"); err == nil {
			t.Fatalf("Provision #%d with uid/gid on a root_squash export succeeded", i+1)
		}
		for _, want := range []string{"root_squash", "1001:2002", "no_root_squash"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("Provision #%d: error %q does not mention %q", i+1, err, want)
			}
		}
		// Not the volume's directory, nor a temp (.dirpv-new-*) or record (.dirpv-vol-*) file.
		if left, err := os.ReadDir(serverDir); err != nil || len(left) > 0 {
			t.Errorf("on the server after the failed Provision #%d: %v (%v)", i+1, left, err)
		}
	}
	t.Logf("Provision with uid/gid on a root_squash export: %v", err)

	pv, err := f.provision(ctx, f.nfsClass("plain", share, options, nil), "d")
	if err != nil {
		t.Fatalf("Provision without uid/gid on a root_squash export: %v", err)
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(serverDir, pv.Spec.CSI.VolumeAttributes["path"]), &st); err != nil {
		t.Fatalf("volume directory on the server: %v", err)
	}
	t.Logf("volume directory on the server is owned by %d:%d (the export's anonymous user)", st.Uid, st.Gid)
	if st.Uid == 0 {
		t.Errorf("volume directory on a root_squash export is owned by root")
	}
}

// TestSameNameClaimsAcrossMounts: claims of one name in different namespaces, provisioned at
// once through two classes that mount one export with different options (two mounts, and no
// RENAME_NOREPLACE in the kernel's NFS client) with pattern ${pvc.metadata.name}: exactly one
// claim gets the directory, every other one is refused, and the directory on the server is
// marked as the winner's.
func TestSameNameClaimsAcrossMounts(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	optsA := []string{"nfsvers=4.2", "hard"}
	optsB := []string{"nfsvers=4.2", "soft", "timeo=600"}
	serverDir, share := exportFor(t, optsA, guest.NoRootSquash)
	f := newController(t, time.Minute)
	pattern := map[string]string{"pathPattern": "${pvc.metadata.name}"}
	classes := []*storagev1.StorageClass{
		f.nfsClass("nfs-a", share, optsA, pattern),
		f.nfsClass("nfs-b", share, optsB, pattern),
	}
	server, err := volume.OpenRoot(serverDir)
	must(t, err)
	defer server.Close()
	const rounds, claims = 10, 8
	for round := range rounds {
		name := fmt.Sprintf("data-%d", round)
		var (
			wg    sync.WaitGroup
			start = make(chan struct{})
			errs  = make([]error, claims)
		)
		uid := func(i int) types.UID { return types.UID(fmt.Sprintf("uid-%d-ns-%d", round, i)) }
		for i := range claims {
			wg.Go(func() {
				<-start
				_, errs[i] = f.provisionIn(ctx, classes[i%2], fmt.Sprintf("ns-%d", i), name, uid(i))
			})
		}
		close(start)
		wg.Wait()
		winner := -1
		for i, err := range errs {
			switch {
			case err == nil && winner >= 0:
				t.Fatalf("round %d: claims ns-%d/%s and ns-%d/%s both got a PV for one directory", round, winner, name, i, name)
			case err == nil:
				winner = i
			case !strings.Contains(err.Error(), "already exists"):
				t.Fatalf("round %d: claim ns-%d/%s: %v, want a PV or a refusal because the directory exists", round, i, name, err)
			}
		}
		if winner < 0 {
			t.Fatalf("round %d: no claim got %s: %v", round, name, errs)
		}
		owner, marked, err := server.VolumeOwner(name)
		if err != nil || !marked || owner.UID != string(uid(winner)) {
			t.Fatalf("round %d: %s on the server is marked %v for %+v (%v), want the winner's claim %s", round, name, marked, owner, err, uid(winner))
		}
	}
	source := guest.NFSAddr + ":" + share
	mounts, err := framework.MountInfosUnder(f.work)
	must(t, err)
	var mounted []string
	for _, mi := range mounts {
		if mi.Source == source {
			mounted = append(mounted, mi.MountPoint)
		}
	}
	if len(mounted) != 2 {
		t.Fatalf("controller mounts of %s: %v, want one per class", source, mounted)
	}
}
