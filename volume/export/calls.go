package export

import (
	"context"
	"fmt"
	"time"

	"github.com/dirpv/dirpv/internal/blocking"
)

// bounded runs fn and waits for it until ctx is done. sem limits how many fn may be running,
// abandoned ones included.
func bounded(ctx context.Context, sem *blocking.Slots, what string, fn func() error) error {
	return boundedOn(ctx, ctx, []*blocking.Slots{sem}, what, fn)
}

// boundedOn is bounded for a call that waits on several exports (a clone from one to
// another), taking slots until ctx is done and abandoning fn once wait is: it takes a slot of
// each, in the order given, so that callers that always order them the same way never
// deadlock each other.
func boundedOn(ctx, wait context.Context, sems []*blocking.Slots, what string, fn func() error) error {
	slots := make([]*blocking.Slot, 0, len(sems))
	release := func() {
		for _, s := range slots {
			s.Release()
		}
	}
	for _, sem := range sems {
		slot, err := sem.Acquire(ctx)
		if err != nil {
			release()
			return fmt.Errorf("%s: %d %w: %w (%w)", what, sem.Size(), errNoSlot, ErrUnresponsive, err)
		}
		slots = append(slots, slot)
	}
	returned, err := blocking.Go(wait, func() error {
		defer release()
		return fn()
	})
	if !returned {
		for _, s := range slots {
			s.Abandon()
		}
		return fmt.Errorf("%s: %w (%w)", what, ErrUnresponsive, context.Cause(wait))
	}
	return err
}

// graceAfter returns a context that ends grace after ctx does: how long a copy told to stop
// may take to notice before its server counts as not answering.
func graceAfter(ctx context.Context, grace time.Duration) (context.Context, context.CancelFunc) {
	wait, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	go func() {
		select {
		case <-ctx.Done():
		case <-wait.Done():
			return
		}
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-t.C:
			cancel(fmt.Errorf("still running %v after it was stopped: %w", grace, context.DeadlineExceeded))
		case <-wait.Done():
		}
	}()
	return wait, func() { cancel(context.Canceled) }
}
