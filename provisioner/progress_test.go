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
	"k8s.io/client-go/tools/record"

	"github.com/dirpv/dirpv/volume"
)

// shortProgress shortens the progress events' spacing for a test.
func shortProgress(t *testing.T, first, most time.Duration) {
	t.Helper()
	oldFirst, oldMax, oldPoll := copyProgressFirst, copyProgressMax, copyStartPoll
	copyProgressFirst, copyProgressMax, copyStartPoll = first, most, time.Millisecond
	t.Cleanup(func() { copyProgressFirst, copyProgressMax, copyStartPoll = oldFirst, oldMax, oldPoll })
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
// what it copied so far, spaced out twice as much each time up to the cap, and nothing once
// stopped.
func TestCopyProgressEvents(t *testing.T) {
	shortProgress(t, 40*time.Millisecond, 100*time.Millisecond)
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

	// A copy that ends before it starts walking (refused) is not reported.
	_, stop := reportCopy(context.Background(), events, w)
	// A window for a wrong event: a reporter that did not wait for the start would send one
	// at once.
	time.Sleep(20 * time.Millisecond)
	stop()
	if n := len(events.Events); n != 0 {
		t.Fatalf("%d events for a copy that never started, want none: %s", n, <-events.Events)
	}

	base := t.TempDir()
	root, err := volume.OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	const src = "src"
	if err := os.MkdirAll(filepath.Join(base, src, "d"), 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if err := os.WriteFile(filepath.Join(base, src, "d", fmt.Sprint(i)), make([]byte, 1000), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ctx, stop := reportCopy(context.Background(), events, w)
	defer stop()
	if _, _, _, err := root.MkdirAllFrom(ctx, "dst", volume.Claim{UID: "u"}, 0, volume.Source{Root: root, Rel: src}); err != nil {
		t.Fatal(err)
	}
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
	// 10,000 bytes), the first after copyProgressFirst, the next ones up to copyProgressMax apart.
	var at []time.Time
	start := time.Now()
	for range 4 {
		for range 2 {
			e := nextEvent(t, events)
			if !strings.HasPrefix(e, "Normal CopyProgress Copying volume a into snapshot s: copied 9.8 KiB in 11 files so far, in ") || on(e) == "" {
				t.Errorf("event %q, want CopyProgress with what was copied", e)
			}
		}
		at = append(at, time.Now())
	}
	stop()
	gaps := []time.Duration{at[0].Sub(start), at[1].Sub(at[0]), at[2].Sub(at[1]), at[3].Sub(at[2])}
	// 40ms, 80ms, 100ms (the cap), 100ms, each at least that long apart (the first counted
	// from a little after the start).
	for i, want := range []time.Duration{20 * time.Millisecond, 80 * time.Millisecond, 100 * time.Millisecond, 100 * time.Millisecond} {
		if gaps[i] < want {
			t.Errorf("progress event %d came %v after the one before, want at least %v (gaps %v)", i+1, gaps[i], want, gaps)
		}
	}
	if n := len(events.Events); n > 2 {
		t.Errorf("%d events after stop, want none (but a report under way)", n)
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
