package provisioner

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/utils/clock"

	"github.com/dirpv/dirpv/volume"
)

// Event reasons of a copy's progress (a clone, a restore, a snapshot), on the claim it makes
// (or the source claim, the VolumeSnapshot and its content for a snapshot).
const (
	ReasonCopyStarted  = "CopyStarted"
	ReasonCopyProgress = "CopyProgress"
)

// The spacing of progress events: the first after copyProgressFirst, each next one twice as
// long after the last, up to copyProgressMax. The recorder lets an object have 25 events at
// once and one more every 5 minutes (client-go's spam filter): copies of hours stay within
// it, and their last events are not dropped.
const (
	copyProgressFirst = 30 * time.Second
	copyProgressMax   = 5 * time.Minute
	// copyStartPoll is how often the reporter looks whether the copy has started walking.
	copyStartPoll = time.Second
)

// copyClock times the progress events; a variable so that a test can step a fake one.
var copyClock clock.WithTicker = clock.RealClock{}

// copyWatch says who is told how a copy goes: what is copied ("PersistentVolumeClaim ns/a
// into the new volume"), and the objects the events go on.
type copyWatch struct {
	what string
	to   []*v1.ObjectReference
	// more, if set, finds further objects once the copy has started: an API read that only
	// copies that run need, off the copy's path.
	more func(context.Context) []*v1.ObjectReference
}

// reportCopy returns ctx counting the copy run under it, and starts telling w's objects how it
// goes: a CopyStarted event once the copy starts walking its source (after its room check: a
// copy refused for lack of space gets its own event instead), then CopyProgress events with
// what it copied so far, spaced out (copyProgressFirst). stop, which may be called again, ends the reports, before the
// copy's outcome is recorded; a copy that ends before it starts (refused) is not reported.
func reportCopy(ctx context.Context, events record.EventRecorder, w *copyWatch) (context.Context, func()) {
	if events == nil || w == nil || len(w.to) == 0 && w.more == nil {
		return ctx, func() {}
	}
	var count volume.CopyCounter
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		clk := copyClock
		poll := clk.NewTicker(copyStartPoll)
		// It looks at each tick only, not at once: a copy over within a tick is not reported,
		// and a fake clock's step decides when the start is seen.
		for {
			select {
			case <-done:
				poll.Stop()
				return
			case <-poll.C():
			}
			if _, _, started := count.Load(); started {
				break
			}
		}
		poll.Stop()
		start := clk.Now()
		to := w.to
		if w.more != nil {
			to = append(w.more(ctx), to...)
		}
		for _, o := range to {
			events.Eventf(o, v1.EventTypeNormal, ReasonCopyStarted, "Copying %s", w.what)
		}
		for wait := copyProgressFirst; ; wait = min(2*wait, copyProgressMax) {
			t := clk.NewTimer(wait)
			select {
			case <-done:
				t.Stop()
				return
			case <-t.C():
			}
			files, bytes, _ := count.Load()
			for _, o := range to {
				events.Eventf(o, v1.EventTypeNormal, ReasonCopyProgress, "Copying %s: copied %s in %s files so far, in %s",
					w.what, formatBytes(bytes), formatCount(files), clk.Since(start).Round(time.Second))
			}
		}
	}()
	var once sync.Once
	return volume.WithCopyCounter(ctx, &count), func() {
		once.Do(func() { close(done) })
		<-stopped
	}
}

// formatBytes says n bytes for people: "1.2 GiB".
func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// formatCount writes n with thousands separated: "35,000".
func formatCount(n int64) string {
	s := strconv.FormatInt(n, 10)
	out := make([]byte, 0, len(s)+len(s)/3)
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 && s[i-1] != '-' {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	return string(out)
}
