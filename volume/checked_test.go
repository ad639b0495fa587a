package volume

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dirpv/dirpv/volume/quota"
)

// moveVolume opens rel and moves it as the provisioner moves a checked volume.
func moveVolume(r *Root, rel, dir, newName string) error {
	v, err := r.OpenVolume(rel)
	if err != nil {
		return err
	}
	defer v.Close()
	return v.Move(dir, newName)
}

// renameVolume opens rel and renames it as the provisioner archives a checked volume.
func renameVolume(r *Root, rel, newName string) error {
	v, err := r.OpenVolume(rel)
	if err != nil {
		return err
	}
	defer v.Close()
	return v.Rename(newName)
}

// replace does what another process may do between a volume's check and the act on it:
// remove the directory at rel and make claim's volume there, with a file in it.
func replace(t *testing.T, r *Root, base, rel string, claim Claim) {
	t.Helper()
	must(t, os.RemoveAll(filepath.Join(base, rel)))
	mkVolume(t, r, rel, Owner{Mode: 0o755, UID: -1, GID: -1}, claim)
	must(t, os.WriteFile(filepath.Join(base, rel, "data"), []byte("new"), 0o644))
}

// reservedIn lists the names in dir that dirpv keeps for itself, owner records left out.
func reservedIn(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	must(t, err)
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ReservedPrefix) && !strings.HasPrefix(e.Name(), recordPrefix) {
			out = append(out, e.Name())
		}
	}
	return out
}

// A volume replaced by another claim's after it was opened and judged is not what Remove,
// Rename or Move act on: they fail with ErrReplaced and the new volume stays where it is,
// whole, with its own marker.
func TestCheckedVolumeReplacedIsLeftAlone(t *testing.T) {
	acts := map[string]func(v *Volume) error{
		"remove": func(v *Volume) error { return v.Remove("pvc-uid-a", quota.ID{}) },
		"rename": func(v *Volume) error { return v.Rename("archived-a") },
		"move":   func(v *Volume) error { return v.Move(".dirpv-trash", "pvc-uid-a") },
	}
	for what, act := range acts {
		t.Run(what, func(t *testing.T) {
			forEachMarker(t, func(t *testing.T, r *Root, base string) {
				mkVolume(t, r, "ns/a", Owner{Mode: 0o755, UID: -1, GID: -1}, claimA)
				must(t, r.Mkdir(".dirpv-trash", 0o700))
				v, err := r.OpenVolume("ns/a")
				must(t, err)
				defer v.Close()
				if owner, marked := v.Owner(); !marked || owner != claimA {
					t.Fatalf("Owner = %+v, %v; want %+v", owner, marked, claimA)
				}
				replace(t, r, base, "ns/a", claimB)

				if err := act(v); !errors.Is(err, ErrReplaced) {
					t.Errorf("%s of the replaced volume: %v, want ErrReplaced", what, err)
				}
				if got, err := os.ReadFile(filepath.Join(base, "ns/a/data")); err != nil || string(got) != "new" {
					t.Errorf("the new volume's file: %q, %v", got, err)
				}
				if owner, _, err := r.VolumeOwner("ns/a"); err != nil || owner != claimB {
					t.Errorf("ns/a belongs to %+v (%v), want the new claim %+v", owner, err, claimB)
				}
				if left := reservedIn(t, filepath.Join(base, "ns")); len(left) != 0 {
					t.Errorf("ns holds %v besides the volume", left)
				}
				if names, err := r.List(".dirpv-trash"); err != nil || len(names) != 0 {
					t.Errorf("trash holds %v (%v), want nothing", names, err)
				}
			})
		})
	}
}

// A Remove stopped after the volume took its private name (a crash) leaves it where a retry
// with the same key finds it, and the retry finishes the job: the whole tree gone, and no name
// left behind, the private one included.
func TestCheckedVolumeRemovalResumed(t *testing.T) {
	forEachMarker(t, func(t *testing.T, r *Root, base string) {
		mkVolume(t, r, "ns/a", Owner{Mode: 0o755, UID: -1, GID: -1}, claimA)
		must(t, os.MkdirAll(filepath.Join(base, "ns/a/sub"), 0o755))
		v, err := r.OpenVolume("ns/a")
		must(t, err)
		// What Remove does before it removes anything.
		must(t, v.move("ns", removalName("a", "pvc-uid-a")))
		v.Close()
		if _, err := r.OpenRemoval("ns/a", "pvc-uid-b"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("OpenRemoval with another key: %v, want ErrNotExist", err)
		}
		left, err := r.OpenRemoval("ns/a", "pvc-uid-a")
		must(t, err)
		if owner, _ := left.Owner(); owner != claimA {
			t.Errorf("left-over volume's owner %+v, want %+v", owner, claimA)
		}
		must(t, left.Remove("pvc-uid-a", quota.ID{}))
		if entries, err := os.ReadDir(filepath.Join(base, "ns")); err != nil || len(entries) != 0 {
			t.Errorf("ns holds %v (%v) after the resumed Remove", entries, err)
		}
	})
}
