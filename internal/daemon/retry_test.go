package daemon

import (
	"testing"
	"time"
)

// TestRetryLimiterIsCapped: a claim or volume that keeps failing is retried after a delay that
// doubles from the start and stops growing at the cap, however many failures there were; the
// defaults are 15 s and 5 min, and a cap below the start is the start.
func TestRetryLimiterIsCapped(t *testing.T) {
	for _, tc := range []struct {
		name       string
		cfg        ProvisionerConfig
		start, max time.Duration
	}{
		{"defaults", ProvisionerConfig{}, 15 * time.Second, 5 * time.Minute},
		{"flags", ProvisionerConfig{RetryIntervalStart: time.Second, RetryIntervalMax: time.Minute}, time.Second, time.Minute},
		{"cap below start", ProvisionerConfig{RetryIntervalStart: time.Minute, RetryIntervalMax: time.Second}, time.Minute, time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := retryLimiter(tc.cfg)
			if d := l.When("pvc-a"); d != tc.start {
				t.Errorf("first retry after %v, want %v", d, tc.start)
			}
			var d time.Duration
			for range 100 {
				d = l.When("pvc-a")
				if d > tc.max {
					t.Fatalf("retry after %v, beyond the cap %v", d, tc.max)
				}
			}
			if d != tc.max {
				t.Errorf("after 100 failures the retry comes after %v, want the cap %v", d, tc.max)
			}
			if n := l.NumRequeues("pvc-a"); n != 101 {
				t.Errorf("%d failures counted, want 101", n)
			}
			if d := l.When("pvc-b"); d != tc.start {
				t.Errorf("another volume's first retry after %v, want %v", d, tc.start)
			}
		})
	}
}
