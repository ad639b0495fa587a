package unmount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"
)

func direct(_ context.Context, _ time.Duration, _ string, fn func() error) error { return fn() }

func isMounted(t *testing.T, dir string) bool {
	t.Helper()
	mps, err := mount.New("").List()
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(mps, func(mp mount.MountPoint) bool { return mp.Path == dir })
}

// A forced unmount that fails leaves the lazy one to take the mount away; one that works is
// the last step; a target that is no mount point (an earlier attempt got through) is done.
func TestForceThenLazy(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to bind mount")
	}
	src, dir := t.TempDir(), filepath.Join(t.TempDir(), "target")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	bind := func() {
		t.Helper()
		if err := unix.Mount(src, dir, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("bind mount: %v", err)
		}
		t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	}

	bind()
	refused := errors.New("forced unmount refused")
	how, err := ForceThenLazy(context.Background(), dir, func() error { return refused }, time.Second, time.Second, direct)
	if err != nil || how != "lazy" || isMounted(t, dir) {
		t.Fatalf("forced step failing: how %q, err %v, still mounted %v; want lazy, nil, false", how, err, isMounted(t, dir))
	}

	bind()
	how, err = ForceThenLazy(context.Background(), dir, Force(dir), time.Second, time.Second, direct)
	if err != nil || how != "forced" || isMounted(t, dir) {
		t.Fatalf("forced step working: how %q, err %v, still mounted %v; want forced, nil, false", how, err, isMounted(t, dir))
	}

	how, err = ForceThenLazy(context.Background(), dir, nil, time.Second, time.Second, direct)
	if err != nil || how != "lazy" {
		t.Fatalf("no mount point: how %q, err %v; want lazy, nil", how, err)
	}

	// Both steps failing: both errors are returned.
	failing := func(_ context.Context, _ time.Duration, what string, _ func() error) error {
		return errors.New(what + " hangs")
	}
	_, err = ForceThenLazy(context.Background(), dir, Force(dir), time.Second, time.Second, failing)
	if err == nil || !strings.Contains(err.Error(), "forced unmount") || !strings.Contains(err.Error(), "lazy unmount") {
		t.Fatalf("both steps failing: %v, want both errors", err)
	}
}
