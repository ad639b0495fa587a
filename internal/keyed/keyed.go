// Package keyed serialises work per key within a process: one holder of a key at a time, any
// number of keys at once, and no memory kept for a key nobody holds or waits for.
package keyed

import (
	"context"
	"fmt"
	"sync"
)

// Locks is a set of mutexes, one per key, made on first use and dropped when the last holder
// or waiter is gone. The zero value is ready to use.
type Locks[K comparable] struct {
	mu   sync.Mutex
	held map[K]*entry
}

type entry struct {
	// token has room for one: whoever puts into it holds the key.
	token chan struct{}
	// users counts the holder and the waiters, guarded by Locks.mu; the last one out deletes
	// the entry.
	users int
}

// Lock waits until key is free or ctx is done, and returns the function that frees it.
func (l *Locks[K]) Lock(ctx context.Context, key K) (unlock func(), err error) {
	e := l.join(key)
	select {
	case e.token <- struct{}{}:
		return func() { <-e.token; l.leave(key, e) }, nil
	case <-ctx.Done():
		l.leave(key, e)
		return nil, fmt.Errorf("waiting for an earlier operation on %v: %w", key, ctx.Err())
	}
}

// MustLock is Lock without a deadline, for holders whose work is bounded by other means.
func (l *Locks[K]) MustLock(key K) (unlock func()) {
	unlock, _ = l.Lock(context.Background(), key)
	return unlock
}

// Users reports how many callers hold or wait for key, for tests that must see a caller
// blocked on a key before they let its holder go on.
func (l *Locks[K]) Users(key K) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.held[key]; e != nil {
		return e.users
	}
	return 0
}

func (l *Locks[K]) join(key K) *entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held == nil {
		l.held = map[K]*entry{}
	}
	e := l.held[key]
	if e == nil {
		e = &entry{token: make(chan struct{}, 1)}
		l.held[key] = e
	}
	e.users++
	return e
}

func (l *Locks[K]) leave(key K, e *entry) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e.users--; e.users == 0 {
		delete(l.held, key)
	}
}
