package integration

// Ownership of existing directories: a volume's marker names the claim it was made for, so a
// claim whose PV was never saved gets its own directory back after a crash, and a PV that is
// not that claim's cannot delete it.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
)

// waitForLog waits until the log file, from offset on, holds a line containing every one of
// substrs, and returns that line.
func waitForLog(t *testing.T, log string, offset int64, substrs ...string) string {
	t.Helper()
	var found string
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		b, err := os.ReadFile(log)
		if err != nil {
			return false, err
		}
		if int64(len(b)) < offset {
			offset = 0
		}
		for _, line := range strings.Split(string(b[offset:]), "\n") {
			if !slices.ContainsFunc(substrs, func(s string) bool { return !strings.Contains(line, s) }) {
				found = line
				return true, nil
			}
		}
		return false, fmt.Errorf("no line in %s with all of %q", log, substrs)
	})
	must(t, err)
	return found
}

func logSize(t *testing.T, log string) int64 {
	t.Helper()
	fi, err := os.Stat(log)
	must(t, err)
	return fi.Size()
}

// dirpv dies after making a claim's directory and before its PV is saved (here the apiserver
// refuses the PV until dirpv is killed). The pattern has no ${pv.metadata.name}, so the
// restarted dirpv finds the directory by name alone: it is the claim's own, so it is adopted,
// data, mode and owner as they were, and the claim binds with exactly that one directory.
func TestCrashBeforePVIsSavedAdoptsDirectory(t *testing.T) {
	ns := suite.NewNamespace(t)
	class, base := localClass(t, map[string]string{
		"pathPattern": "${pvc.metadata.namespace}-${pvc.metadata.name}", "mode": "2750", "uid": "1234", "gid": "5678",
	})
	allow := blockPVsOf(t, ns, []string{"crashy"})
	offset := logSize(t, nodeProc.Log)
	c := suite.CreateClaim(t, ns, "crashy", class.Name, framework.OnNode(nodeA))
	pvName := "pvc-" + string(c.UID)
	waitForLog(t, nodeProc.Log, offset, "Failed to save persistentvolume", pvName)
	dir := filepath.Join(base, ns+"-crashy")
	if err := os.WriteFile(filepath.Join(dir, "before-crash"), []byte("kept"), 0o600); err != nil {
		t.Fatalf("the claim's directory was not made before its PV: %v", err)
	}
	nodeProc.Kill()
	allow()
	offset = logSize(t, nodeProc.Log)
	must(t, nodeProc.Restart())
	_, pv := waitBound(t, ns, "crashy")
	line := waitForLog(t, nodeProc.Log, offset, "adopted existing directory", ns+"-crashy")
	t.Logf("restarted node-a: %s", line)
	if got := pv.Spec.CSI.VolumeAttributes["path"]; got != ns+"-crashy" {
		t.Errorf("PV path %q, want %s-crashy", got, ns)
	}
	if got := entries(t, base); !slices.Equal(got, []string{ns + "-crashy"}) {
		t.Errorf("base holds %q, want only the adopted directory", got)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "before-crash")); err != nil || string(b) != "kept" {
		t.Errorf("adopted directory's file: %q %v", b, err)
	}
	fi, err := os.Stat(dir)
	must(t, err)
	st := fi.Sys().(*syscall.Stat_t)
	if fi.Mode()&os.ModePerm != 0o750 || fi.Mode()&os.ModeSetgid == 0 || st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("adopted directory mode %v owner %d:%d, want 2750 1234:5678", fi.Mode(), st.Uid, st.Gid)
	}
	if pvs := pvsOf(t, ns); len(pvs) != 1 {
		t.Errorf("PVs of claim crashy: %v, want 1", pvs)
	}
}

// A PV written by hand that names another claim's volume (or a stale PV whose directory was
// made anew for another claim) is released: its Delete is refused with an event, and the
// volume and its data stay. On NFS too, where onDelete delete moves the directory to the
// trash, whose background walk would remove the other claim's data.
func TestDeleteOfAnotherClaimsDirectoryIsRefused(t *testing.T) {
	for _, b := range lifecycleBackends() {
		t.Run(b.name, func(t *testing.T) {
			ns := suite.NewNamespace(t)
			class, dir := b.class(t, map[string]string{"pathPattern": "${pvc.metadata.namespace}-${pvc.metadata.name}"})
			suite.CreateClaim(t, ns, "owner", class, b.claim...)
			_, owned := waitBound(t, ns, "owner")
			data := filepath.Join(dir, owned.Spec.CSI.VolumeAttributes["path"], "data")
			must(t, os.WriteFile(data, []byte("owner's data"), 0o600))

			stale := owned.DeepCopy()
			stale.ObjectMeta = metav1.ObjectMeta{Name: "stale-" + ns, Annotations: owned.Annotations}
			stale.Spec.CSI.VolumeHandle = volume.Handle(volume.Backend(b.name), stale.Name)
			stale.Spec.ClaimRef = &v1.ObjectReference{Namespace: ns, Name: "stale"}
			stale.Status = v1.PersistentVolumeStatus{}
			_, err := suite.Client.CoreV1().PersistentVolumes().Create(context.Background(), stale, metav1.CreateOptions{})
			must(t, err)
			t.Cleanup(func() {
				ctx := context.Background()
				patch := []byte(`{"metadata":{"finalizers":null},"spec":{"persistentVolumeReclaimPolicy":"Retain"}}`)
				suite.Client.CoreV1().PersistentVolumes().Patch(ctx, stale.Name, types.MergePatchType, patch, metav1.PatchOptions{})
				suite.Client.CoreV1().PersistentVolumes().Delete(ctx, stale.Name, metav1.DeleteOptions{})
			})
			claim := framework.NewClaim(ns, "stale", class, b.claim...)
			claim.Spec.VolumeName = stale.Name
			_, err = suite.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), claim, metav1.CreateOptions{})
			must(t, err)
			waitBound(t, ns, "stale")
			deleteClaim(t, ns, "stale")
			ev := waitEvent(t, "", "PersistentVolume", stale.Name, "VolumeFailedDelete", "belongs to another claim")
			t.Logf("stale PV's Delete refused: %s", ev.Message)
			if b, err := os.ReadFile(data); err != nil || string(b) != "owner's data" {
				t.Errorf("owner's data after the refused Delete: %q %v", b, err)
			}
			if _, err := suite.Client.CoreV1().PersistentVolumes().Get(context.Background(), stale.Name, metav1.GetOptions{}); err != nil {
				t.Errorf("the refused PV: %v, want it kept", err)
			}
		})
	}
}
