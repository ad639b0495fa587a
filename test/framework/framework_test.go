package framework

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// A test that waits for its pod to succeed learns that the pod failed as soon as it did, not
// after the wait's whole timeout (minutes per failure in the pod tiers).
func TestWaitForPodPhaseStopsAtTheOtherEnd(t *testing.T) {
	for _, tc := range []struct{ have, want v1.PodPhase }{
		{v1.PodFailed, v1.PodSucceeded},
		{v1.PodSucceeded, v1.PodRunning},
	} {
		pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"}, Status: v1.PodStatus{Phase: tc.have}}
		// The deadline only bounds a broken wait; the error, not the time, is what is checked.
		_, err := WaitForPodPhase(context.Background(), fake.NewClientset(pod), "ns", "p", tc.want, time.Minute)
		if err == nil || !strings.Contains(err.Error(), "it ended "+string(tc.have)) {
			t.Errorf("waiting for a %s pod to be %s: %v, want an error that says it ended %s", tc.have, tc.want, err, tc.have)
		}
	}
	running := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"}, Status: v1.PodStatus{Phase: v1.PodRunning}}
	if _, err := WaitForPodPhase(context.Background(), fake.NewClientset(running), "ns", "p", v1.PodRunning, time.Minute); err != nil {
		t.Errorf("waiting for a Running pod to be Running: %v", err)
	}
}

// CheckCounting returns once the writer's log grew past what was seen, and fails at once on a
// log that is not the counter the writer appends (a gap: writes lost, a file replaced).
func TestCheckCounting(t *testing.T) {
	reads := 0
	growing := func(context.Context) ([]byte, error) {
		reads++
		var b strings.Builder
		for i := range 2 + reads {
			fmt.Fprintf(&b, "%d\n", i)
		}
		b.WriteString("9") // a line being written
		return []byte(b.String()), nil
	}
	if n, err := CheckCounting(context.Background(), growing, 4, time.Minute); err != nil || n != 5 {
		t.Errorf("a growing log, after 4 lines: %d, %v; want 5 lines", n, err)
	}
	gap := func(context.Context) ([]byte, error) { return []byte("0\n1\n3\n"), nil }
	start := time.Now()
	if _, err := CheckCounting(context.Background(), gap, 0, time.Minute); err == nil || !strings.Contains(err.Error(), `line 2 is "3"`) {
		t.Errorf("a log with a gap: %v, want an error naming line 2", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("a log with a gap failed after %s, want at once", d)
	}
}
