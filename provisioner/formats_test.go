package provisioner

import (
	"bytes"
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// goldenBase stands for the test's base path in the stored PV.
const goldenBase = "/var/lib/dirpv"

// The PV is dirpv's longest-lived record in the API: Delete reads it years after Provision
// wrote it, from a version that may be newer. testdata/formats holds each form a PV has had;
// today's Provision must write the newest byte for byte, and Delete must act on every one. A
// change of format fails here until its new form is added as a file of its own, next to the
// old ones, which must go on working: never edit or delete one (volume's formats_test.go
// holds the on-disk formats and the attributes the same way).
func TestLocalPVFormat(t *testing.T) {
	f := newFixture(t)
	class := f.localClass(map[string]string{"onDelete": "archive"})
	pvc := claim("data")
	pv, _, err := f.node.Provision(context.Background(), opts(class, pvc))
	must(t, err)
	file := filepath.Join("testdata", "formats", "pv-local-v1.json")
	stored := checkPVFormat(t, pv, goldenBase, file)

	// Delete of the stored form archives the volume that Provision made.
	if err := f.node.Delete(context.Background(), stored); err != nil {
		t.Fatalf("Delete of %s: %v", file, err)
	}
	names := listTree(t, f.base)
	if len(names) != 1 || !strings.HasPrefix(names[0], "archived-") {
		t.Errorf("base after Delete of %s (onDelete archive): %v, want only the archived volume", file, names)
	}
}

// checkPVFormat compares pv with the stored form in file, where basePath is storedBase and
// there is no quota attribute (whether the test's base enforces sizes depends on the machine;
// volume's formats test holds the quota attribute), and returns the stored form with pv's
// attributes back, for Delete to act on.
func checkPVFormat(t *testing.T, pv *v1.PersistentVolume, storedBase, file string) *v1.PersistentVolume {
	t.Helper()
	golden := pv.DeepCopy()
	golden.Spec.CSI.VolumeAttributes["basePath"] = storedBase
	delete(golden.Spec.CSI.VolumeAttributes, "quota")
	got, err := json.MarshalIndent(golden, "", "  ")
	must(t, err)
	want, err := os.ReadFile(file)
	must(t, err)
	if !bytes.Equal(append(got, '\n'), want) {
		t.Errorf("today's PV differs from %s; a new format needs a file of its own:\n%s", file, got)
	}
	var stored v1.PersistentVolume
	must(t, json.Unmarshal(want, &stored))
	stored.Spec.CSI.VolumeAttributes = maps.Clone(pv.Spec.CSI.VolumeAttributes)
	return &stored
}
