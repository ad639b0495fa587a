package framework

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
)

// The kill tests' checks must be able to fail. These run them on a fake API (the real one is
// what test/integration and test/e2e/install use) against states that break each invariant.

func claim(name, uid, volume string) *v1.PersistentVolumeClaim {
	c := &v1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID(uid)}}
	c.Spec.VolumeName = volume
	if volume != "" {
		c.Status.Phase = v1.ClaimBound
	}
	return c
}

func pv(name, claimName, claimUID, path string) *v1.PersistentVolume {
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeSpec{
			ClaimRef: &v1.ObjectReference{Namespace: "ns", Name: claimName, UID: types.UID(claimUID)},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver: "dirpv.io", VolumeHandle: name, VolumeAttributes: map[string]string{"path": path},
			}},
		},
	}
}

func TestCheckOnePVPerClaimFindsEachViolation(t *testing.T) {
	ctx := context.Background()
	good := []runtime.Object{claim("a", "uid-a", "pv-a"), pv("pv-a", "a", "uid-a", "ns-a")}
	for _, tc := range []struct {
		name    string
		objects []runtime.Object
		dirs    []string
		want    string // "" means no problem
	}{
		{"consistent", good, []string{"ns-a"}, ""},
		// A second PV for the same claim under another name: the API accepts it, only a count
		// by claim UID sees it.
		{"two PVs for one claim", append(slices.Clone(good), pv("pv-a2", "a", "uid-a", "ns-a2")), []string{"ns-a", "ns-a2"}, "has 2 PVs"},
		{"claim without PV", append(slices.Clone(good), claim("b", "uid-b", "")), []string{"ns-a"}, "claim b (uid uid-b) has 0 PVs"},
		{"orphan directory", good, []string{"ns-a", "ns-left-behind"}, "orphan directory ns-left-behind"},
		{"PV without directory", good, nil, "PV pv-a has no directory"},
		{"shared directory", []runtime.Object{claim("a", "uid-a", "pv-a"), claim("b", "uid-b", "pv-b"),
			pv("pv-a", "a", "uid-a", "ns-x"), pv("pv-b", "b", "uid-b", "ns-x")}, []string{"ns-x"}, "share directory ns-x"},
		{"PV of a claim that is gone", append(slices.Clone(good), pv("pv-old", "old", "uid-old", "ns-old")), []string{"ns-a", "ns-old"}, "which is no claim in ns"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			problems, err := CheckOnePVPerClaim(ctx, fake.NewClientset(tc.objects...), "ns", tc.dirs)
			must(t, err)
			if tc.want == "" {
				if len(problems) != 0 {
					t.Errorf("problems %q, want none", problems)
				}
				return
			}
			if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, tc.want) }) {
				t.Errorf("problems %q, want one saying %q", problems, tc.want)
			}
		})
	}
}

func TestCheckAdoptedNeedsTheSameDirectory(t *testing.T) {
	ctx := context.Background()
	base := t.TempDir()
	for _, d := range []string{"ns-held", "ns-done", "ns-replaced"} {
		must(t, os.Mkdir(filepath.Join(base, d), 0o755))
	}
	atKill := fake.NewClientset(claim("done", "uid-done", "pv-done"), pv("pv-done", "done", "uid-done", "ns-done"),
		claim("held", "uid-held", ""), claim("replaced", "uid-replaced", ""), claim("late", "uid-late", ""))
	snap, err := TakeKillSnapshot(ctx, atKill, "ns", base, func(string) bool { return true })
	must(t, err)
	if snap.Bound != 1 || snap.Total != 4 || len(snap.Dirs) != 3 || !snap.PVPaths["ns-done"] {
		t.Fatalf("snapshot: %+v", snap)
	}
	// After the restart: "late" got a directory that did not exist at the kill, "replaced" a
	// new one under the old name.
	must(t, os.Mkdir(filepath.Join(base, "ns-late"), 0o755))
	// Removed and made again: even if the file system gave it the old inode number, the canary
	// planted at the kill is gone.
	must(t, os.RemoveAll(filepath.Join(base, "ns-replaced")))
	must(t, os.Mkdir(filepath.Join(base, "ns-replaced"), 0o755))
	after := fake.NewClientset(
		claim("done", "uid-done", "pv-done"), pv("pv-done", "done", "uid-done", "ns-done"),
		claim("held", "uid-held", "pv-held"), pv("pv-held", "held", "uid-held", "ns-held"),
		claim("replaced", "uid-replaced", "pv-replaced"), pv("pv-replaced", "replaced", "uid-replaced", "ns-replaced"),
		claim("late", "uid-late", "pv-late"), pv("pv-late", "late", "uid-late", "ns-late"))
	for claimName, want := range map[string]string{
		"held":     "",
		"replaced": "directory ns-replaced was ",
		"late":     "did not exist at the kill",
		"done":     "already had a PV at the kill",
	} {
		problems, err := snap.CheckAdopted(ctx, after, "ns", []string{claimName})
		must(t, err)
		switch {
		case want == "" && len(problems) != 0:
			t.Errorf("%s: problems %q, want none", claimName, problems)
		case want != "" && (len(problems) != 1 || !strings.Contains(problems[0], want)):
			t.Errorf("%s: problems %q, want one saying %q", claimName, problems, want)
		}
	}
}
