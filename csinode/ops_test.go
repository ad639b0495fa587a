package csinode

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
)

func TestSingleFlightRefusesPileUp(t *testing.T) {
	sf := newSingleFlight()
	hang := make(chan struct{})
	defer close(hang)
	ctx := context.Background()
	err := sf.do(ctx, "/p", "statfs /p", 50*time.Millisecond, func() error { <-hang; return nil })
	if !isTimeout(err) || codeOf(err) != codes.DeadlineExceeded {
		t.Fatalf("hung call: %v", err)
	}
	// The first call is still blocked: a second one must not start another.
	started := false
	err = sf.do(ctx, "/p", "statfs /p", time.Second, func() error { started = true; return nil })
	if !errors.Is(err, errStillPending) || started {
		t.Fatalf("second call: %v (started %t)", err, started)
	}
	// Other paths are independent.
	must(t, sf.do(ctx, "/q", "statfs /q", time.Second, func() error { return nil }))
}

func TestKeyedLockWaitsAndTimesOut(t *testing.T) {
	l := newKeyedLock()
	ctx := context.Background()
	s1, err := l.lock(ctx, "k", time.Second)
	must(t, err)
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := l.lock(short, "k", time.Second); codeOf(err) != codes.Aborted {
		t.Fatalf("lock of a held key: %v", err)
	}
	got := make(chan error, 1)
	go func() {
		s, err := l.lock(ctx, "k", time.Second)
		if err == nil {
			s.release()
		}
		got <- err
	}()
	s1.release()
	if err := <-got; err != nil {
		t.Fatalf("waiter: %v", err)
	}
}

// codeOf is the gRPC code a handler would answer for err.
func codeOf(err error) codes.Code { return grpcstatus.Code(toStatus(err)) }
