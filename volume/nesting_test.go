package volume

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// Two classes may share a base with patterns of different depths, say ${annotations['dir']}
// and ${labels['team']}/${pvc.metadata.name}. A tenant of the first then owns a volume
// "finance"; a claim of the second with team=finance must not get a directory inside that
// volume, where the first tenant could read and change it and where deleting the first
// volume would delete it.
func TestMkdirAllRefusesToNestInsideAnotherVolume(t *testing.T) {
	r, base := newRoot(t)
	owner := Owner{Mode: 0o777, UID: -1, GID: -1}
	if created, err := r.MkdirAll("finance", owner); err != nil || !created {
		t.Fatalf("first volume: %v %v", created, err)
	}
	_, err := r.MkdirAll("finance/victim", owner)
	if !errors.Is(err, ErrInsideVolume) {
		t.Fatalf("volume inside another volume: err %v, want ErrInsideVolume", err)
	}
	if _, err := os.Lstat(filepath.Join(base, "finance/victim")); !os.IsNotExist(err) {
		t.Errorf("finance/victim exists after the refusal: %v", err)
	}
	_, err = r.MkdirAll("finance/a/b/victim", owner)
	if !errors.Is(err, ErrInsideVolume) {
		t.Fatalf("volume deep inside another volume: err %v, want ErrInsideVolume", err)
	}

	// Intermediate directories dirpv made are not volumes: siblings share them.
	for _, rel := range []string{"ns/a", "ns/b"} {
		if created, err := r.MkdirAll(rel, owner); err != nil || !created {
			t.Fatalf("%s: %v %v", rel, created, err)
		}
	}
	// An existing volume is found again (a retried Provision), not refused.
	if created, err := r.MkdirAll("ns/a", owner); err != nil || created {
		t.Fatalf("existing volume: %v %v", created, err)
	}
	// The marker is a trusted.* attribute: a pod (without CAP_SYS_ADMIN) can neither forge it
	// nor strip it, and it lives on the directory, so it survives a restart of dirpv.
	if _, err := unix.Lgetxattr(filepath.Join(base, "ns/a"), volumeMarker, make([]byte, 8)); err != nil {
		t.Errorf("volume ns/a has no %s: %v", volumeMarker, err)
	}
	if _, err := unix.Lgetxattr(filepath.Join(base, "ns"), volumeMarker, make([]byte, 8)); err == nil {
		t.Errorf("intermediate ns is marked as a volume")
	}
}
