package provisioner

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
)

// newClaimOfSameName is the claim a user makes again under the name of one whose PV is being
// deleted; with a pattern without ${pv.metadata.name} its volume gets the same path.
var newClaimOfSameName = volume.Claim{UID: "uid-c-renewed", PVName: "pvc-uid-c-renewed"}

// makeVolumeAt does what another process than the test's Provisioner may do at rel in the
// base at base while a Delete is held after its check (a second dirpv during an update, an
// admin's script; this process's per-volume lock holds none of them back): remove whatever is
// there and make the volume of newClaimOfSameName, with a file in it.
func makeVolumeAt(t *testing.T, base, rel string) {
	t.Helper()
	must(t, os.RemoveAll(filepath.Join(base, rel)))
	root, err := volume.OpenRoot(base)
	must(t, err)
	defer root.Close()
	_, err = root.MkdirAll(rel, volume.Owner{Mode: 0o755, UID: -1, GID: -1}, newClaimOfSameName)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(base, rel, "data"), []byte("new claim's"), 0o644))
}

// checkNewVolume fails the test unless rel in base is the volume makeVolumeAt made, whole.
func checkNewVolume(t *testing.T, base, rel string) {
	t.Helper()
	if got, err := os.ReadFile(filepath.Join(base, rel, "data")); err != nil || string(got) != "new claim's" {
		t.Errorf("the volume another process made at %s after the check: %q, %v", rel, got, err)
		return
	}
	root, err := volume.OpenRoot(base)
	must(t, err)
	defer root.Close()
	if owner, _, err := root.VolumeOwner(rel); err != nil || owner != newClaimOfSameName {
		t.Errorf("volume %s belongs to %+v (%v), want the new claim %+v", rel, owner, err, newClaimOfSameName)
	}
}

// deleteHeldAtCheck starts Delete of pv by p, holds it between the owner check and the act on
// the directory, runs meanwhile, and returns what Delete returned once let go.
func deleteHeldAtCheck(t *testing.T, p *Provisioner, pv *v1.PersistentVolume, meanwhile func()) error {
	t.Helper()
	deleted, release := runHeldAt(t, failpoint.DeleteChecked, func() error { return p.Delete(context.Background(), pv) })
	meanwhile()
	release()
	select {
	case err := <-deleted:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("Delete did not return after it was let go")
		return nil
	}
}

// Delete removes, archives or moves to the trash (NFS) the directory it checked, or nothing: a
// volume that another process makes at the path after the check (the PV's directory was gone
// at the check, or went after it) is left whole, neither removed nor sent to the background
// walk, with a pattern without ${pv.metadata.name} giving the same path to a claim made again
// under the same name.
func TestDeleteActsOnTheCheckedDirectory(t *testing.T) {
	for _, backend := range []volume.Backend{volume.BackendLocal, volume.BackendNFS} {
		for _, policy := range []string{"delete", "archive"} {
			for _, when := range []string{"gone at the check", "replaced after the check"} {
				t.Run(string(backend)+"/"+policy+"/"+when, func(t *testing.T) {
					s := newStoreFixture(t, backend, map[string]string{"pathPattern": "${pvc.metadata.namespace}-${pvc.metadata.name}", "onDelete": policy})
					old := s.claim("c")
					pv, _, err := s.p.Provision(context.Background(), opts(s.class, old))
					must(t, err)
					pv.Spec.ClaimRef = &v1.ObjectReference{Namespace: old.Namespace, Name: old.Name, UID: old.UID}
					rel := pv.Spec.CSI.VolumeAttributes[volume.AttrPath]
					if when == "gone at the check" {
						// The lib retries a Delete whose result it did not see, after the walk is done.
						must(t, s.p.Delete(context.Background(), pv))
						s.settle(t)
					}
					if err := deleteHeldAtCheck(t, s.p, pv, func() { makeVolumeAt(t, s.base, rel) }); err != nil {
						t.Errorf("Delete: %v", err)
					}
					checkNewVolume(t, s.base, rel)
					s.settle(t)
					// Only the first Delete of the retried one archives anything.
					wantArchived := 0
					if policy == "archive" && when == "gone at the check" {
						wantArchived = 1
					}
					var others, archived []string
					for _, e := range listTree(t, s.base) {
						switch {
						case strings.HasPrefix(e, "archived-"):
							if !strings.Contains(e, "/") {
								archived = append(archived, e)
							}
						case e != rel && e != rel+"/data" && e != export.TrashDir:
							others = append(others, e)
						}
					}
					if len(others) != 0 || len(archived) != wantArchived {
						t.Errorf("base holds %v and archived %v besides the new volume, want %d archived", others, archived, wantArchived)
					}
				})
			}
		}
	}
}
