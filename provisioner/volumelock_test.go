package provisioner

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// holdAt makes the first goroutine that reaches point wait there until the returned release
// is called; reached is closed when it got there. Other points, and later arrivals, pass.
func holdAt(t *testing.T, point string) (reached <-chan struct{}, release func()) {
	t.Helper()
	at, gate := make(chan struct{}), make(chan struct{})
	first := make(chan struct{}, 1)
	first <- struct{}{}
	restore := failpoint.SetOnReach(func(name string) {
		if name != point {
			return
		}
		select {
		case <-first:
			close(at)
			<-gate
		default:
		}
	})
	released := false
	release = func() {
		if !released {
			released = true
			close(gate)
		}
	}
	t.Cleanup(func() { release(); restore() })
	return at, release
}

// runHeldAt runs op on a goroutine of its own and returns once op is held at point (holdAt);
// done gets what op returns once released.
func runHeldAt(t *testing.T, point string, op func() error) (done <-chan error, release func()) {
	t.Helper()
	reached, release := holdAt(t, point)
	result := make(chan error, 1)
	go func() { result <- op() }()
	select {
	case <-reached:
	case err := <-result:
		t.Fatalf("returned (%v) without reaching %s", err, point)
	case <-time.After(30 * time.Second):
		t.Fatalf("never reached %s", point)
	}
	return result, release
}

// waitQueued waits until the operation started on the volume at attrs is blocked behind the
// one holding it (two users of its lock), or until done says it finished without waiting.
func waitQueued(t *testing.T, p *Provisioner, attrs volume.Attributes, done <-chan error) (finished bool) {
	t.Helper()
	key := storeName(attrs) + "\x00/" + attrs.Path
	deadline := time.After(30 * time.Second)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for p.volumeLocks.Users(key) < 2 {
		select {
		case err := <-done:
			t.Logf("the second operation finished while the first was held (err %v)", err)
			return true
		case <-deadline:
			t.Fatal("the second operation neither finished nor waited for the first")
		case <-tick.C:
		}
	}
	return false
}

// A stale PV's retried Delete that found no directory at its path, held there, must not then
// remove the volume a new claim of the same name (a pattern without ${pv.metadata.name})
// makes at that path: the new claim's Provision waits for the Delete to finish.
func TestRetriedDeleteSparesNewClaimAtSamePath(t *testing.T) {
	f := newFixture(t)
	class := f.localClass(map[string]string{"pathPattern": "${pvc.metadata.namespace}-${pvc.metadata.name}"})
	old := claim("c")
	pv, _, err := f.node.Provision(context.Background(), opts(class, old))
	must(t, err)
	pv.Spec.ClaimRef = &v1.ObjectReference{Namespace: old.Namespace, Name: old.Name, UID: old.UID}
	must(t, f.node.Delete(context.Background(), pv))
	rel := pv.Spec.CSI.VolumeAttributes[volume.AttrPath]
	if _, err := os.Lstat(filepath.Join(f.base, rel)); !os.IsNotExist(err) {
		t.Fatalf("volume directory after Delete: %v", err)
	}

	// The lib's retry.
	deleted, release := runHeldAt(t, failpoint.DeleteChecked, func() error { return f.node.Delete(context.Background(), pv) })
	renewed := claim("c")
	renewed.UID = types.UID("uid-c-renewed")
	provisioned := make(chan error, 1)
	go func() {
		_, _, err := f.node.Provision(context.Background(), opts(class, renewed))
		provisioned <- err
	}()
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	must(t, err)
	if waitQueued(t, f.node, attrs, provisioned) {
		provisioned <- nil
	}
	release()
	must(t, <-deleted)
	must(t, <-provisioned)
	root, err := volume.OpenRoot(f.base)
	must(t, err)
	defer root.Close()
	owner, _, err := root.VolumeOwner(rel)
	if err != nil {
		t.Fatalf("the new claim's volume %s: %v", rel, err)
	}
	if owner.UID != string(renewed.UID) {
		t.Errorf("volume %s belongs to %q, want the new claim %q", rel, owner.UID, renewed.UID)
	}
}

// A Resize held between reading the volume's quota ID and raising its limit keeps the
// volume's Delete waiting, so the limit is never raised on an ID the Delete has released.
func TestDeleteWaitsForResizeOfSameVolume(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	f := newFixtureOn(t, mnt)
	pvc, pv := f.boundLocalVolume()
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	must(t, err)
	group := "0/" + strings.TrimPrefix(attrs.Quota, "btrfs/")
	if limit := quotatest.Qgroups(t, mnt)[group]; limit == "" || limit == "none" {
		t.Fatalf("volume's qgroup %s has limit %q, want one (qgroups %v)", group, limit, quotatest.Qgroups(t, mnt))
	}

	resized, release := runHeldAt(t, failpoint.ResizeChecked, func() error {
		_, _, err := f.node.Resizer(context.Background()).Resize(pv, resource.MustParse("32Mi"))
		return err
	})
	released := pv.DeepCopy()
	released.Status.Phase = v1.VolumeReleased
	deleted := make(chan error, 1)
	go func() { deleted <- f.node.Delete(context.Background(), released) }()
	if waitQueued(t, f.node, attrs, deleted) {
		t.Errorf("Delete of claim %s's volume ran while its Resize was between the quota ID and the limit", pvc.Name)
		deleted <- nil
	}
	release()
	if err := <-resized; err != nil {
		t.Errorf("Resize: %v", err)
	}
	if err := <-deleted; err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(mnt, attrs.Path)); !os.IsNotExist(err) {
		t.Errorf("volume directory after Delete: %v", err)
	}
	if limit, ok := quotatest.Qgroups(t, mnt)[group]; ok && limit != "none" {
		t.Errorf("qgroup %s of the deleted volume still has limit %s", group, limit)
	}
}
