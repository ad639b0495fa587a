package daemon

import (
	"runtime/debug"
	"testing"
)

// Both processes run with DefaultGCPercent, unless GOGC says otherwise.
func TestTuneGC(t *testing.T) {
	prev := debug.SetGCPercent(100)
	defer debug.SetGCPercent(prev)
	for _, tc := range []struct {
		gogc string
		want int
	}{{"", DefaultGCPercent}, {"100", 100}, {"off", 100}} {
		t.Run("GOGC="+tc.gogc, func(t *testing.T) {
			t.Setenv("GOGC", tc.gogc)
			debug.SetGCPercent(100)
			tuneGC()
			if got := debug.SetGCPercent(100); got != tc.want {
				t.Errorf("GC percent after tuneGC with GOGC=%q: %d, want %d", tc.gogc, got, tc.want)
			}
		})
	}
}
