package volume

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// The formats dirpv writes where a later version must read them: volume markers (trusted
// attribute or NFS record file), base IDs and the node's base records, PV volume attributes
// and snapshot handles (in the API, kept for as long as the PV or VolumeSnapshotContent). Each
// stored form in testdata/formats is read by today's decoder and must give the value listed
// here; today's encoder must write the newest form byte for byte. A change of format
// therefore fails here until its new form is added as a file of its own, next to the old ones,
// which must go on decoding: never edit or delete one.

func golden(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "formats", name))
	must(t, err)
	return b
}

func TestVolumeMarkerFormats(t *testing.T) {
	for _, c := range []struct {
		file  string
		want  marker
		write bool // today's encoder writes this form
	}{
		{"marker-v0.txt", marker{marked: true}, false},
		{"marker-v1.json", marker{marked: true, quota: "project/4711", owner: Claim{
			UID: "0b5e0a4c-7f3e-4d0e-9c61-3f1f6f3b2a10", PVName: "pvc-0b5e0a4c-7f3e-4d0e-9c61-3f1f6f3b2a10"}}, true},
		{"marker-v1-nfs.json", marker{marked: true, owner: Claim{
			UID: "5d6c1f2e-1111-4a2b-8c3d-9e8f7a6b5c4d", PVName: "pvc-5d6c1f2e-1111-4a2b-8c3d-9e8f7a6b5c4d"}}, true},
	} {
		b := golden(t, c.file)
		got, err := decodeMarker(b)
		if err != nil || got != c.want {
			t.Errorf("%s: decoded %+v, %v; want %+v", c.file, got, err, c.want)
		}
		if enc := encodeMarker(c.want.owner, c.want.quota); c.write && !bytes.Equal(enc, b) {
			t.Errorf("%s: today's marker is %s; a new format needs a file of its own", c.file, enc)
		}
	}
}

func TestBaseIdentityFormats(t *testing.T) {
	id := string(golden(t, "base-id-v1.txt"))
	if got, err := checkBaseID("/base", id); err != nil || got != id {
		t.Errorf("base ID %q: %q, %v", id, got, err)
	}
	b := golden(t, "base-record-v1.json")
	want := baseRecord{Path: "/var/lib/dirpv/disk1", ID: id, HeldVolumes: true}
	dir := t.TempDir()
	records := NewBaseRecords(dir)
	must(t, os.WriteFile(records.RecordPath(want.Path), b, 0o600))
	if got, err := records.read(want.Path); err != nil || got == nil || *got != want {
		t.Errorf("base record: %+v, %v; want %+v", got, err, want)
	}
	must(t, records.write(want))
	if written, _ := os.ReadFile(records.RecordPath(want.Path)); !bytes.Equal(written, b) {
		t.Errorf("today's base record is %s; a new format needs a file of its own", written)
	}
}

func TestVolumeAttributeFormats(t *testing.T) {
	for _, c := range []struct {
		file string
		want Attributes
	}{
		{"attributes-v1-local.json", Attributes{Backend: BackendLocal, BasePath: "/var/lib/dirpv", Path: "team-a/data-pvc-1", Quota: "btrfs/257"}},
		{"attributes-v1-nfs.json", Attributes{Backend: BackendNFS, Server: "nfs.example.com", Share: "/exports/k8s", Path: "team-a-data-pvc-2"}},
	} {
		var m map[string]string
		must(t, json.Unmarshal(golden(t, c.file), &m))
		if got, err := ParseAttributes(m); err != nil || got != c.want {
			t.Errorf("%s: %+v, %v; want %+v", c.file, got, err, c.want)
		}
		if !reflect.DeepEqual(c.want.Map(), m) {
			t.Errorf("%s: today's attributes are %v; a new format needs a file of its own", c.file, c.want.Map())
		}
	}
}

func TestSnapshotHandleFormats(t *testing.T) {
	for _, c := range []struct {
		file string
		want SnapshotHandle
	}{
		{"snapshot-handle-v1-local.txt", SnapshotHandle{Backend: BackendLocal, BasePath: "/var/lib/dirpv", Node: "worker-1",
			Name: "snapshot-7c1d", Size: 1 << 30}},
		{"snapshot-handle-v1-nfs.txt", SnapshotHandle{Backend: BackendNFS, Server: "nfs.example.com", Share: "/exports/k8s",
			MountOptions: []string{"nfsvers=4.2", "hard"}, Name: "snapshot-9e2f", Size: 5 << 30}},
	} {
		s := strings.TrimSpace(string(golden(t, c.file)))
		if got, err := ParseSnapshotHandle(s); err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %+v, %v; want %+v", c.file, got, err, c.want)
		}
		if c.want.String() != s {
			t.Errorf("%s: today's handle is %s; a new format needs a file of its own", c.file, c.want.String())
		}
	}
}
