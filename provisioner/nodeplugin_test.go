package provisioner

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

func uidN(i int) types.UID { return types.UID(fmt.Sprintf("uid-%d", i)) }

// TestClaimChecksSweepIsAmortised: with n claims pending, a resync that asks about each of
// them (each due, since a period passed) sweeps the map once, not once per claim: the work is
// O(n) per resync, not O(n²). Claims nobody asks about any more are still forgotten.
func TestClaimChecksSweepIsAmortised(t *testing.T) {
	const n = 2000
	var c claimChecks
	t0 := time.Unix(1_000_000, 0)
	for i := range n {
		c.due(uidN(i), t0)
	}
	for round := 1; round <= 3; round++ {
		now := t0.Add(time.Duration(round) * nodePluginCheckPeriod)
		before := c.swept
		for i := range n {
			if !c.due(uidN(i), now.Add(time.Duration(i)*time.Millisecond)) {
				t.Fatalf("round %d: claim %d not due a period after its last check", round, i)
			}
		}
		if swept := c.swept - before; swept > 2*n {
			t.Fatalf("round %d: asking about %d claims swept %d map entries: the map is swept on every call", round, n, swept)
		}
	}
	// The claims got bound: only one other is asked about from now on.
	last := t0.Add(3*nodePluginCheckPeriod + n*time.Millisecond)
	for i := 1; i <= 3; i++ {
		c.due("other", last.Add(time.Duration(i)*nodePluginCheckPeriod))
	}
	if len(c.last) > 1 {
		t.Errorf("%d claims remembered, want only the one still asked about", len(c.last))
	}
}

// TestClaimChecksConcurrent: workers asking about the same claims at once (as the lib's do)
// get each claim due exactly once per period, sweeps included, and not again before the
// period is over. Run with -race.
func TestClaimChecksConcurrent(t *testing.T) {
	const claims, workers = 200, 8
	var c claimChecks
	t0 := time.Unix(1_000_000, 0)
	for round := range 3 {
		now := t0.Add(time.Duration(round) * nodePluginCheckPeriod)
		var dues atomic.Int64
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for i := range claims {
					if c.due(uidN((i+w*7)%claims), now) {
						dues.Add(1)
					}
				}
			})
		}
		wg.Wait()
		if got := dues.Load(); got != claims {
			t.Errorf("round %d: %d checks due for %d claims", round, got, claims)
		}
		if c.due(uidN(0), now.Add(nodePluginCheckPeriod-time.Second)) {
			t.Errorf("round %d: a claim checked less than a period ago is due again", round)
		}
	}
}
