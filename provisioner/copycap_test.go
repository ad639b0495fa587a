package provisioner

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/internal/blocking"
	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/internal/metricstest"
)

// Five clones on a node that lets two copies run at once: two copy while three wait, as
// dirpv_copies_running and dirpv_copies_waiting say, and never more than two run, until all
// five are done and their files counted in dirpv_copied_files_total. Copies are held where
// they start (failpoint.CopyStarted) until the test lets them go.
func TestLocalCopiesCapped(t *testing.T) {
	const clones, limit, files = 5, 2, 10
	f := newFixture(t)
	f.node.localCopies = blocking.NewSlots(limit)
	f.node.copies.inline = time.Nanosecond
	class := f.localClass(nil)
	src := f.sourceClaim(t, class, "src", "1Gi", fillFiles(files))

	var mu sync.Mutex
	held, most := 0, 0
	gate := make(chan struct{})
	defer failpoint.SetOnReach(func(name string) {
		if name != failpoint.CopyStarted {
			return
		}
		mu.Lock()
		held++
		most = max(most, held)
		mu.Unlock()
		<-gate
		mu.Lock()
		held--
		mu.Unlock()
	})()
	released := false
	defer func() {
		if !released {
			close(gate)
		}
	}()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(&copiesCollector{p: f.node})
	gauge := func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("%d copies held at their start (at most %d so far); dirpv_copies_running %v, dirpv_copies_waiting %v",
			held, most, metricstest.Value(t, reg, "dirpv_copies_running", nil), metricstest.Value(t, reg, "dirpv_copies_waiting", nil))
	}
	filesBefore := metricstest.Value(t, reg, "dirpv_copied_files_total", nil)

	all := make([]controller.ProvisionOptions, clones)
	for i := range all {
		all[i] = f.cloneOf(t, class, fmt.Sprintf("clone-%d", i), src)
		if _, state, err := f.node.Provision(context.Background(), all[i]); state != controller.ProvisioningInBackground {
			t.Fatalf("clone %d: %s, %v; want its copy in the background", i, state, err)
		}
	}
	want := fmt.Sprintf("%d copies held at their start (at most %d so far); dirpv_copies_running %d, dirpv_copies_waiting %d", limit, limit, limit, clones-limit)
	eventually(t, 10*time.Second, func() (bool, string) {
		got := gauge()
		mu.Lock()
		over := most > limit
		mu.Unlock()
		if over {
			t.Fatalf("more than %d copies ran at once: %s", limit, got)
		}
		return got == want, fmt.Sprintf("%s; want %s", got, want)
	})

	released = true
	close(gate)
	for i, o := range all {
		eventually(t, 10*time.Second, func() (bool, string) {
			_, state, err := f.node.Provision(context.Background(), o)
			if state == controller.ProvisioningFinished && err != nil {
				t.Fatalf("clone %d: %v", i, err)
			}
			return state == controller.ProvisioningFinished, fmt.Sprintf("clone %d is still copying: %s", i, gauge())
		})
	}
	mu.Lock()
	if most != limit {
		t.Errorf("at most %d copies ran at once, want %d", most, limit)
	}
	mu.Unlock()
	if got := gauge(); got != fmt.Sprintf("0 copies held at their start (at most %d so far); dirpv_copies_running 0, dirpv_copies_waiting 0", limit) {
		t.Errorf("after the copies: %s", got)
	}
	// The counter is the process's: other tests' copies may add to it, never take away.
	if got := metricstest.Value(t, reg, "dirpv_copied_files_total", nil) - filesBefore; got < clones*files {
		t.Errorf("dirpv_copied_files_total grew by %v, want at least %d", got, clones*files)
	}
}
