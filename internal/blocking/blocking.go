// Package blocking runs calls that may block in the kernel for good (a syscall on a dead NFS
// server, mount(8) or umount(8) that never return) and that cannot be cancelled, only
// abandoned: the caller stops waiting at its deadline while the call carries on, and Slots cap
// how many such calls, abandoned ones included, may be running at once.
package blocking

import (
	"context"
	"sync"
	"time"
)

// Go runs fn in a goroutine of its own and waits for it until wait is done. It reports
// whether fn returned, and fn's error if it did. Once wait is done fn is abandoned: it runs on
// to its end, so whatever it must give back when it returns (a slot, a lock) it gives back
// itself, in fn.
func Go(wait context.Context, fn func() error) (returned bool, err error) {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return true, err
	case <-wait.Done():
		return false, nil
	}
}

// Slots caps the calls that may be running at once on one thing (an NFS export), abandoned
// ones included, so that a dead server costs a fixed number of goroutines instead of one per
// retry. Besides the cap they keep what health checks and metrics report: how many calls
// their callers abandoned that still run, and since when every slot has been taken without
// one coming free.
type Slots struct {
	ch chan struct{}

	mu        sync.Mutex
	abandoned int
	fullSince time.Time
}

// NewSlots returns n slots.
func NewSlots(n int) *Slots { return &Slots{ch: make(chan struct{}, n)} }

// Size returns how many slots there are.
func (s *Slots) Size() int { return cap(s.ch) }

// Acquire takes a slot, or returns ctx's error once ctx is done.
func (s *Slots) Acquire(ctx context.Context) (*Slot, error) {
	select {
	case s.ch <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	s.mu.Lock()
	// Slots come free only under mu (Release), so a full channel seen here is really full.
	if len(s.ch) == cap(s.ch) && s.fullSince.IsZero() {
		s.fullSince = time.Now()
	}
	s.mu.Unlock()
	return &Slot{s: s}, nil
}

// Abandoned returns how many calls holding a slot their callers stopped waiting for.
func (s *Slots) Abandoned() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.abandoned
}

// FullSince returns since when every slot has been taken, none coming free, or zero if one
// is free.
func (s *Slots) FullSince() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fullSince
}

// Slot is one taken slot.
type Slot struct {
	s         *Slots
	abandoned bool
	released  bool
}

// Abandon records that the caller stopped waiting while the call still runs.
func (c *Slot) Abandon() {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if !c.released && !c.abandoned {
		c.abandoned = true
		c.s.abandoned++
	}
}

// Release frees the slot when the call has returned.
func (c *Slot) Release() {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	c.released = true
	if c.abandoned {
		c.s.abandoned--
	}
	<-c.s.ch
	c.s.fullSince = time.Time{}
}

// WaitGroup waits for wg until deadline fires, and reports whether wg finished.
func WaitGroup(wg *sync.WaitGroup, deadline <-chan time.Time) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-deadline:
		return false
	}
}
