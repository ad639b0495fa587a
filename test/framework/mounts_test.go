package framework

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The mount-table helpers run against real bind mounts (the tests run as root): the suites'
// "nothing left mounted" checks are only as good as these.
func TestMountsUnder(t *testing.T) {
	dir := t.TempDir()
	src, a, deep, sibling := filepath.Join(dir, "src"), filepath.Join(dir, "a"), filepath.Join(dir, "a", "b"), dir+"-sibling"
	for _, d := range []string{src, deep, sibling} {
		must(t, os.MkdirAll(d, 0o755))
	}
	t.Cleanup(func() { DetachMountsUnder(dir); DetachMountsUnder(sibling); os.Remove(sibling) })
	// a, then a/b inside it, and a directory whose name only starts like dir's.
	for _, target := range []string{a, deep, sibling} {
		if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("bind mount %s: %v", target, err)
		}
		// Private: where / is shared (as after a kubelet ran here), the mount at a/b would
		// also appear at src/b, through a's peer group.
		must(t, unix.Mount("", target, "", unix.MS_PRIVATE, ""))
		if target == a {
			must(t, os.MkdirAll(deep, 0o755))
		}
	}

	got, err := MountsUnder(dir)
	must(t, err)
	if want := []string{deep, a}; !slices.Equal(got, want) {
		t.Errorf("MountsUnder(%s) = %v, want %v (deepest first, not the sibling)", dir, got, want)
	}
	if err := WaitForNoMountsUnder(context.Background(), dir, 300*time.Millisecond); err == nil {
		t.Error("WaitForNoMountsUnder returned nil while two mounts are there")
	}

	DetachMountsUnder(dir)
	if err := WaitForNoMountsUnder(context.Background(), dir, 10*time.Second); err != nil {
		t.Error(err)
	}
	if got, _ := MountsUnder(sibling); len(got) != 1 {
		t.Errorf("DetachMountsUnder(%s) touched %s: mounts there now %v", dir, sibling, got)
	}
}
