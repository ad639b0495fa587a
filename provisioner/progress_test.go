package provisioner

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/tools/record"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/dirpv/dirpv/volume"
)

// fakeCopyClock makes the progress reports run on a fake clock for a test.
func fakeCopyClock(t *testing.T) *clocktesting.FakeClock {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	old := copyClock
	copyClock = clk
	t.Cleanup(func() { copyClock = old })
	return clk
}

// waitWaiters waits until n timers and tickers wait on clk: the reporter is blocked on it,
// so that a step is seen by it.
func waitWaiters(t *testing.T, clk *clocktesting.FakeClock, n int) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		return clk.Waiters() == n, nil
	})
	if err != nil {
		t.Fatalf("%d waiters on the clock, want %d", clk.Waiters(), n)
	}
}

// nextEvent returns the next event recorded, failing the test if none comes within a while.
func nextEvent(t *testing.T, events *record.FakeRecorder) string {
	t.Helper()
	select {
	case e := <-events.Events:
		return e
	case <-time.After(10 * time.Second):
		t.Fatal("no event")
		return ""
	}
}

// A copy reported on two objects: nothing before it starts walking its source (a copy refused
// for lack of space stops before), then CopyStarted on each object, then CopyProgress with
// what it copied so far, at 30 s, then spaced twice as much each time up to 5 min, and
// nothing once stopped.
func TestCopyProgressEvents(t *testing.T) {
	events := record.NewFakeRecorder(100)
	events.IncludeObject = true
	claim := &v1.ObjectReference{Kind: kindPVC, APIVersion: "v1", Namespace: "ns", Name: "copy"}
	snap := &v1.ObjectReference{Kind: "VolumeSnapshot", APIVersion: snapshotAPIVersion, Namespace: "ns", Name: "snap"}
	// The snapshot is found once the copy has started, as a Snapshotter finds it.
	w := &copyWatch{what: "volume a into snapshot s", to: []*v1.ObjectReference{claim},
		more: func(context.Context) []*v1.ObjectReference { return []*v1.ObjectReference{snap} }}
	on := func(e string) string {
		_, kind, _ := strings.Cut(e, " involvedObject{kind=")
		kind, _, _ = strings.Cut(kind, ",")
		return kind
	}

	// A copy that ends before it starts walking (refused) is not reported, however long the
	// reporter looks.
	clk := fakeCopyClock(t)
	_, stop := reportCopy(context.Background(), events, w)
	waitWaiters(t, clk, 1)
	for range 5 {
		clk.Step(copyStartPoll)
	}
	// stop returns once the reporter has ended: all it sent is recorded.
	stop()
	if n := len(events.Events); n != 0 {
		t.Fatalf("%d events for a copy that never started, want none: %s", n, <-events.Events)
	}

	base := t.TempDir()
	root, err := volume.OpenRoot(base)
	must(t, err)
	defer root.Close()
	const src = "src"
	must(t, os.MkdirAll(filepath.Join(base, src, "d"), 0o755))
	for i := range 10 {
		must(t, os.WriteFile(filepath.Join(base, src, "d", fmt.Sprint(i)), make([]byte, 1000), 0o644))
	}
	clk = fakeCopyClock(t)
	ctx, stop := reportCopy(context.Background(), events, w)
	defer stop()
	_, _, _, err = root.MkdirAllFrom(ctx, "dst", volume.Claim{UID: "u"}, 0, volume.Source{Root: root, Rel: src})
	must(t, err)
	// The reporter sees the start at its next look, a tick after.
	waitWaiters(t, clk, 1)
	clk.Step(copyStartPoll)
	got := map[string]bool{}
	for range 2 {
		e := nextEvent(t, events)
		if !strings.HasPrefix(e, "Normal CopyStarted Copying volume a into snapshot s involvedObject") {
			t.Errorf("event %q, want CopyStarted", e)
		}
		got[on(e)] = true
	}
	if !got[kindPVC] || !got["VolumeSnapshot"] {
		t.Errorf("CopyStarted on %v, want the claim and the VolumeSnapshot", got)
	}
	// The copy is done: each report says all it copied (10 files and their directory;
	// 10,000 bytes) and how long since it started. Time moves a second at a time; a report
	// is due only at these times since the start (30 s, then 1, 2, 4, 5, 5 min apart).
	due := map[time.Duration]bool{}
	for _, d := range []time.Duration{30 * time.Second, 90 * time.Second, 210 * time.Second, 450 * time.Second, 750 * time.Second, 1050 * time.Second} {
		due[d] = true
	}
	for since := time.Second; since <= 20*time.Minute; since += time.Second {
		// The start's ticker, which a fake clock keeps after Stop, and the next report's timer.
		waitWaiters(t, clk, 2)
		clk.Step(time.Second)
		if !due[since] {
			continue
		}
		for range 2 {
			want := "Normal CopyProgress Copying volume a into snapshot s: copied 9.8 KiB in 11 files so far, in " + since.String() + " involvedObject"
			if e := nextEvent(t, events); !strings.HasPrefix(e, want) || on(e) == "" {
				t.Fatalf("event %q, want %q", e, want)
			}
		}
	}
	stop()
	if n := len(events.Events); n != 0 {
		t.Errorf("%d events not due, want none: %s", n, <-events.Events)
	}
}

func TestFormatProgress(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1024: "1.0 KiB", 1288490189: "1.2 GiB", 5 << 40: "5.0 TiB"} {
		if got := formatBytes(n); got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", n, got, want)
		}
	}
	for n, want := range map[int64]string{0: "0", 999: "999", 1000: "1,000", 35000: "35,000", 1234567: "1,234,567"} {
		if got := formatCount(n); got != want {
			t.Errorf("formatCount(%d) = %q, want %q", n, got, want)
		}
	}
}
