package keyed

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
)

// One holder per key at a time, keys independent of each other, and nothing kept once every
// holder is gone.
func TestLocksSerialisePerKey(t *testing.T) {
	var l Locks[string]
	var mu sync.Mutex
	inside := map[string]int{}
	var wg sync.WaitGroup
	for i := range 200 {
		key := []string{"a", "b"}[i%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			unlock := l.MustLock(key)
			mu.Lock()
			inside[key]++
			if inside[key] != 1 {
				t.Errorf("%d holders of %s at once", inside[key], key)
			}
			mu.Unlock()
			mu.Lock()
			inside[key]--
			mu.Unlock()
			unlock()
		}()
	}
	wg.Wait()
	if len(l.held) != 0 {
		t.Errorf("entries left after every holder went: %v", l.held)
	}
}

// A waiter whose context ends gives up with its error, counts no longer, and leaves the key
// to its holder.
func TestLockGivesUpWithItsContext(t *testing.T) {
	var l Locks[int]
	unlock := l.MustLock(1)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := l.Lock(ctx, 1)
		errc <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for l.Users(1) != 2 {
		if time.Now().After(deadline) {
			t.Fatal("the waiter never queued")
		}
		runtime.Gosched()
	}
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Lock after cancel = %v, want context.Canceled", err)
	}
	if n := l.Users(1); n != 1 {
		t.Errorf("users after the waiter gave up = %d, want 1", n)
	}
	unlock()
	if n := l.Users(1); n != 0 {
		t.Errorf("users after unlock = %d, want 0", n)
	}
}
