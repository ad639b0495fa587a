package blocking

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A call that returns in time gives its error; one that does not is abandoned at the deadline
// and still runs to its end.
func TestGoAbandonsAtDeadline(t *testing.T) {
	want := errors.New("boom")
	if returned, err := Go(context.Background(), func() error { return want }); !returned || !errors.Is(err, want) {
		t.Fatalf("call that returns: returned %v, err %v; want true, %v", returned, err, want)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	unblock, ended := make(chan struct{}), make(chan struct{})
	start := time.Now()
	returned, err := Go(ctx, func() error {
		defer close(ended)
		<-unblock
		return nil
	})
	if returned || err != nil {
		t.Fatalf("blocked call: returned %v, err %v; want false, nil", returned, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("abandoning took %v", d)
	}
	select {
	case <-ended:
		t.Fatal("the abandoned call ended before it was unblocked")
	default:
	}
	close(unblock)
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the abandoned call never ran to its end")
	}
}

// Slots cap the calls, count the abandoned ones until they return, and say since when they
// are all taken.
func TestSlotsCapAndReport(t *testing.T) {
	s := NewSlots(2)
	if s.Size() != 2 {
		t.Fatalf("Size = %d, want 2", s.Size())
	}
	a, err := s.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !s.FullSince().IsZero() {
		t.Fatal("full with one slot of two taken")
	}
	b, err := s.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.FullSince().IsZero() {
		t.Fatal("not full with both slots taken")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("third acquire: %v, want context.DeadlineExceeded", err)
	}
	a.Abandon()
	a.Abandon()
	if n := s.Abandoned(); n != 1 {
		t.Fatalf("Abandoned = %d after abandoning one call twice, want 1", n)
	}
	a.Release()
	if n := s.Abandoned(); n != 0 {
		t.Fatalf("Abandoned = %d after the abandoned call returned, want 0", n)
	}
	if !s.FullSince().IsZero() {
		t.Fatal("still full after a slot came free")
	}
	b.Release()
	b.Abandon() // after its release: the call returned, nothing to count
	if n := s.Abandoned(); n != 0 {
		t.Fatalf("Abandoned = %d after abandoning a released slot, want 0", n)
	}
}
