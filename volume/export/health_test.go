package export

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// An export whose every call slot is held by calls the server never answers makes the
// controller unhealthy once that has lasted longer than the limit, and healthy again when the
// server answers. Calls that finish in time never count.
func TestHealthFailsWhileAnExportIsWedged(t *testing.T) {
	e := New(mount.NewFakeMounter(nil), t.TempDir(), 500*time.Millisecond)
	t.Cleanup(func() { e.Close(context.Background()) })
	const server, share = "nfs.example", "/export"

	// A healthy server: calls come back, nothing is stuck.
	must(t, e.Do(context.Background(), server, share, nil, func(*volume.Root) error { return nil }))
	if err := e.Healthy(time.Nanosecond); err != nil {
		t.Fatalf("healthy export reported wedged: %v", err)
	}

	answer := make(chan struct{})
	hang := func(*volume.Root) error { <-answer; return nil }
	var wg sync.WaitGroup
	for range maxStuckCalls {
		wg.Go(func() {
			if err := e.Do(context.Background(), server, share, nil, hang); !errors.Is(err, ErrUnresponsive) {
				t.Errorf("call on a hung server: %v, want ErrUnresponsive", err)
			}
		})
	}
	wg.Wait()
	st := e.Status()
	if len(st) != 1 || st[0].Export != server+":"+share || st[0].Stuck != maxStuckCalls || !st[0].Saturated {
		t.Fatalf("exports: %+v, want %s:%s with %d stuck calls, saturated", st, server, share, maxStuckCalls)
	}
	// The calls that timed out dropped the mount, so a new call either finds every slot taken
	// or waits behind the unmount, which waits for a slot too: refused either way, in time.
	err := e.Do(context.Background(), server, share, nil, func(*volume.Root) error { return nil })
	if !errors.Is(err, ErrUnresponsive) ||
		!(strings.Contains(err.Error(), fmt.Sprint(maxStuckCalls)+" earlier calls") || strings.Contains(err.Error(), "waiting to mount")) {
		t.Errorf("call on a saturated export: %v, want it refused for the %d earlier calls", err, maxStuckCalls)
	}
	if err := e.Healthy(time.Hour); err != nil {
		t.Errorf("saturated for less than the limit, yet unhealthy: %v", err)
	}
	const limit = 300 * time.Millisecond
	eventually(t, 5*time.Second, func() (bool, string) { return e.Healthy(limit) != nil, "healthy after the limit" })
	if err := e.Healthy(limit); !strings.Contains(err.Error(), server+":"+share) {
		t.Errorf("health error does not name the export: %v", err)
	}

	close(answer)
	eventually(t, 5*time.Second, func() (bool, string) {
		st := e.Status()
		return e.Healthy(limit) == nil && len(st) == 1 && st[0].Stuck == 0 && !st[0].Saturated,
			fmt.Sprintf("once the server answers: %v, exports %+v; want healthy, nothing stuck", e.Healthy(limit), st)
	})
}
