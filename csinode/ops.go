package csinode

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/dirpv/dirpv/internal/blocking"
)

// keyedLock serialises operations per key (volume ID and target path), so that kubelet
// retrying a slow NodePublishVolume, or calling NodeUnpublishVolume while a publish still runs,
// never has two mount(8) processes racing on one target.
type keyedLock struct {
	mu   sync.Mutex
	held map[string]*lockEntry
}

type lockEntry struct {
	released chan struct{}
	// orphaned is set when the handler holding the key has returned but a mount or unmount it
	// started has not: later callers fail fast instead of waiting out their whole deadline.
	orphaned bool
}

func newKeyedLock() *keyedLock { return &keyedLock{held: map[string]*lockEntry{}} }

// errOperationPending means another operation on the same key still runs.
var errOperationPending = errors.New("an earlier operation on this volume and target is still in progress")

// lock waits until key is free or ctx is done, and fails at once if the key is held by an
// orphaned operation. The returned scope's release gives the key back once every call made
// through the scope has finished, possibly after the handler itself has returned.
func (l *keyedLock) lock(ctx context.Context, key string, timeout time.Duration) (*opScope, error) {
	for {
		l.mu.Lock()
		e, busy := l.held[key]
		if !busy {
			e = &lockEntry{released: make(chan struct{})}
			l.held[key] = e
			l.mu.Unlock()
			return &opScope{lock: l, key: key, entry: e, timeout: timeout}, nil
		}
		orphaned := e.orphaned
		l.mu.Unlock()
		if orphaned {
			return nil, errOperationPending
		}
		select {
		case <-e.released:
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", errOperationPending, ctx.Err())
		}
	}
}

// opScope is one handler's hold on a key. Blocking file system calls run through call, which
// bounds the time the handler waits while still tracking the call to its end.
type opScope struct {
	lock    *keyedLock
	key     string
	entry   *lockEntry
	timeout time.Duration
	pending sync.WaitGroup
	late    int // calls the handler stopped waiting for; only the handler goroutine touches it
}

// timeoutError marks a call that did not finish within its deadline.
type timeoutError struct {
	what string
	err  error // context.DeadlineExceeded or context.Canceled
}

func (e *timeoutError) Error() string {
	if errors.Is(e.err, context.Canceled) {
		return fmt.Sprintf("%s: caller gave up (it continues in the background)", e.what)
	}
	return fmt.Sprintf("%s did not finish in time (it continues in the background; operations on the same target wait for it)", e.what)
}

func (e *timeoutError) Unwrap() error { return e.err }

// call runs fn in its own goroutine and waits for it until the earlier of ctx's deadline and
// the operation timeout. mount-utils runs mount(8)/umount(8) without a context, and a statfs on
// a dead hard-mounted NFS server blocks in the kernel, so giving up waiting is the only way to
// keep a gRPC handler from wedging. The key stays locked until fn really returns.
func (s *opScope) call(ctx context.Context, what string, fn func() error) error {
	return runBounded(ctx, s.timeout, what, &s.pending, &s.late, fn)
}

// runBounded runs fn through blocking.Go, waiting at most timeout; wg, if set, tracks fn to its
// end, and late, if set, counts it when the caller stopped waiting first.
func runBounded(ctx context.Context, timeout time.Duration, what string, wg *sync.WaitGroup, late *int, fn func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if wg != nil {
		wg.Add(1)
	}
	returned, err := blocking.Go(ctx, func() error {
		if wg != nil {
			defer wg.Done()
		}
		return fn()
	})
	if !returned {
		if late != nil {
			*late++
		}
		return &timeoutError{what: what, err: ctx.Err()}
	}
	return err
}

// release gives the key back, at once if every call finished, otherwise when the last one does.
func (s *opScope) release() {
	free := func() {
		s.lock.mu.Lock()
		delete(s.lock.held, s.key)
		s.lock.mu.Unlock()
		close(s.entry.released)
	}
	if s.late == 0 {
		free()
		return
	}
	s.lock.mu.Lock()
	s.entry.orphaned = true
	s.lock.mu.Unlock()
	go func() {
		s.pending.Wait()
		free()
	}()
}

// singleFlight keeps at most one statfs per path in flight. A statfs hung on a dead NFS server
// never returns; without this every stats poll from kubelet would leave one more goroutine
// blocked in the kernel.
type singleFlight struct {
	mu       sync.Mutex
	inFlight map[string]bool
}

func newSingleFlight() *singleFlight { return &singleFlight{inFlight: map[string]bool{}} }

var errStillPending = errors.New("an earlier call on this path has not returned yet")

// do runs fn bounded by ctx and timeout unless a call for key is still running.
func (f *singleFlight) do(ctx context.Context, key, what string, timeout time.Duration, fn func() error) error {
	f.mu.Lock()
	if f.inFlight[key] {
		f.mu.Unlock()
		return fmt.Errorf("%s: %w", what, errStillPending)
	}
	f.inFlight[key] = true
	f.mu.Unlock()
	return runBounded(ctx, timeout, what, nil, nil, func() error {
		defer func() {
			f.mu.Lock()
			delete(f.inFlight, key)
			f.mu.Unlock()
		}()
		return fn()
	})
}

// publishedSet remembers which targets this process published for which volume. It is a hint
// for NodeGetVolumeHealth (which may come without a path) and for matching a stats path to its
// volume; it is empty after a restart, so nothing relies on it for correctness: the mount table
// is the source of truth.
type publishedSet struct {
	mu      sync.Mutex
	targets map[string]map[string]struct{} // volume ID -> target paths
}

func newPublishedSet() *publishedSet {
	return &publishedSet{targets: map[string]map[string]struct{}{}}
}

func (p *publishedSet) add(volumeID, target string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.targets[volumeID] == nil {
		p.targets[volumeID] = map[string]struct{}{}
	}
	p.targets[volumeID][target] = struct{}{}
}

func (p *publishedSet) remove(volumeID, target string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.targets[volumeID], target)
	if len(p.targets[volumeID]) == 0 {
		delete(p.targets, volumeID)
	}
}

// list returns the targets known for volumeID.
func (p *publishedSet) list(volumeID string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for t := range p.targets[volumeID] {
		out = append(out, t)
	}
	return out
}

// owner returns the volume ID known to be published at target, or "".
func (p *publishedSet) owner(target string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, ts := range p.targets {
		if _, ok := ts[target]; ok {
			return id
		}
	}
	return ""
}
