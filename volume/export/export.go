// Package export keeps the controller's mounts of NFS exports, one per (server, share, mount
// options) under its work dir, and runs every call on them within a deadline: call slots cap
// the calls a dead server may hold (calls.go), a mount that stops answering is dropped and
// forced off (mount.go), idle ones are swept, deleted volumes are removed from the export's
// trash in the background (trash.go), and Status and Healthy report wedged exports (health.go).
package export

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/internal/blocking"
	"github.com/dirpv/dirpv/volume"
)

// maxStuckCalls caps the calls that may wait on one NFS export at once. A call on a dead NFS
// server blocks in the kernel and cannot be cancelled, only abandoned; the cap makes a dead
// server cost a fixed number of goroutines instead of one per retry.
const maxStuckCalls = 8

// maxCopies caps the copies (clones, snapshots) running on one export at once. Copies have
// their own slots: one runs for as long as its tree takes, and were they to hold ordinary
// call slots, a few would leave none for the export's other claims.
const maxCopies = 8

// ErrUnresponsive marks calls abandoned because the NFS server did not answer in time.
var ErrUnresponsive = errors.New("NFS server did not answer in time")

// errNoSlot marks calls that never ran because the export's cap was full until the deadline.
var errNoSlot = errors.New("earlier calls are still waiting for the server")

// errShuttingDown refuses calls that arrive after the exports were released for shutdown.
var errShuttingDown = errors.New("dirpv controller is shutting down")

// exportKey identifies one controller-side mount: a mount per (server, share, options), since
// classes that differ in mount options must not share a mount.
func exportKey(server, share string, options []string) string {
	opts := slices.Clone(options)
	slices.Sort(opts)
	return volume.ExportSource(server, share) + " " + strings.Join(opts, ",")
}

// Exports keeps one mount of each NFS export the controller serves, under workDir, unmounts
// those left unused, and removes deleted volumes in the background (trash.go).
type Exports struct {
	mounter mount.Interface
	workDir string
	timeout time.Duration
	// logger is for background work, which outlives the call that started it.
	logger klog.Logger

	// bg ends background work at shutdown.
	bg     context.Context
	stopBg context.CancelFunc
	// running tracks background unmounts and trash scans; walking, background deletes.
	running, walking sync.WaitGroup
	// beforeStep, if set, runs before each step of a background delete (tests hold walks).
	beforeStep func()

	mu     sync.Mutex
	byKey  map[string]*export
	closed bool
	// pending counts trash entries not yet removed; removals counts removals started.
	pending, removals int
}

type export struct {
	source  string
	options []string
	dir     string
	// sem caps the calls, abandoned ones included, that may wait on the server; forceSem the
	// forced and lazy unmounts, which do not wait on it and so need their own slots;
	// copySem the copies (maxCopies).
	sem, forceSem, copySem *blocking.Slots
	// lock serialises mounting and unmounting and guards root and gen; a channel so that
	// waiters honour their deadline.
	lock chan struct{}
	// root is the mount's own handle. Callers get a duplicate (acquire), so closing this one
	// at unmount never pulls a handle from under a caller, nor lets a reused descriptor
	// number point a late caller at another export.
	root *volume.Root
	// gen counts mounts, so that a caller drops only the mount its call failed on.
	gen uint64
	// lockedSince is when lock was taken, in Unix nanoseconds, 0 while it is free: a lock
	// held far longer than any bounded step means a step is hung (Healthy).
	lockedSince atomic.Int64

	// Guarded by exports.mu. users counts calls and background deletes under way: an export
	// with users is never unmounted as idle.
	mounted, unmounting bool
	users               int
	lastUsed            time.Time
	trash               trashQueue
}

// New returns the exports of a controller that mounts them under workDir with mounter and
// bounds each call on them by timeout.
func New(mounter mount.Interface, workDir string, timeout time.Duration) *Exports {
	bg, stop := context.WithCancel(context.Background())
	return &Exports{mounter: mounter, workDir: workDir, timeout: timeout, logger: klog.Background(),
		bg: bg, stopBg: stop, byKey: map[string]*export{}}
}

// get returns the export for (server, share, options), creating its record on first use.
func (e *Exports) get(server, share string, options []string) *export {
	key := exportKey(server, share, options)
	e.mu.Lock()
	defer e.mu.Unlock()
	ex, ok := e.byKey[key]
	if !ok {
		sum := sha256.Sum256([]byte(key))
		ex = &export{
			source:   volume.ExportSource(server, share),
			options:  slices.Clone(options),
			dir:      filepath.Join(e.workDir, "exports", hex.EncodeToString(sum[:8])),
			sem:      blocking.NewSlots(maxStuckCalls),
			forceSem: blocking.NewSlots(2),
			copySem:  blocking.NewSlots(maxCopies),
			lock:     make(chan struct{}, 1),
		}
		e.byKey[key] = ex
	}
	return ex
}

// background runs fn in a goroutine that Close waits for, unless shutdown began. The
// caller holds e.mu.
func (e *Exports) background(wg *sync.WaitGroup, fn func()) bool {
	if e.closed {
		return false
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		fn()
	}()
	return true
}

// Do runs fn on the export's root, mounting the export first if needed. fn runs under the
// operation timeout; if the server does not answer, or answers that the mount went stale,
// the mount is dropped so the next call mounts afresh once the server is back.
func (e *Exports) Do(ctx context.Context, server, share string, options []string, fn func(*volume.Root) error) error {
	return e.run(ctx, e.get(server, share, options), fn)
}

func (e *Exports) run(ctx context.Context, ex *export, fn func(*volume.Root) error) error {
	return e.runOn(ctx, 0, []*export{ex}, func(_ context.Context, roots []*volume.Root) error { return fn(roots[0]) })
}

// Ref names one export a call needs.
type Ref struct {
	Server, Share string
	Options       []string
}

// DoPair runs fn, a copy from one export to another, on the roots of both, a's first,
// mounting them first if needed, under timeout rather than the operation timeout: a copy
// takes as long as its tree. Mounting is still bounded by the operation timeout. When a and
// b are one export, fn gets its root twice and the call takes one slot.
func (e *Exports) DoPair(ctx context.Context, timeout time.Duration, a, b Ref, fn func(ctx context.Context, ra, rb *volume.Root) error) error {
	exA, exB := e.get(a.Server, a.Share, a.Options), e.get(b.Server, b.Share, b.Options)
	if exA == exB {
		return e.runOn(ctx, timeout, []*export{exA}, func(ctx context.Context, roots []*volume.Root) error {
			return fn(ctx, roots[0], roots[0])
		})
	}
	// Slots are taken in the order of the exports' keys, whichever is the source, so that
	// clones running both ways between two exports never hold one slot each while waiting
	// for the other's.
	exs, swapped := []*export{exA, exB}, false
	if exportKey(a.Server, a.Share, a.Options) > exportKey(b.Server, b.Share, b.Options) {
		exs, swapped = []*export{exB, exA}, true
	}
	return e.runOn(ctx, timeout, exs, func(ctx context.Context, roots []*volume.Root) error {
		if swapped {
			return fn(ctx, roots[1], roots[0])
		}
		return fn(ctx, roots[0], roots[1])
	})
}

// runOn runs fn on the roots of exs, each mounted first if needed, within the operation
// timeout; or, if copyTimeout is set, fn is a copy (DoPair), which stops when its ctx ends,
// and gets copyTimeout and the export's copy slots.
func (e *Exports) runOn(ctx context.Context, copyTimeout time.Duration, exs []*export, fn func(context.Context, []*volume.Root) error) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return fmt.Errorf("NFS %s: %w", exs[0].source, errShuttingDown)
	}
	for _, ex := range exs {
		ex.users++
	}
	e.mu.Unlock()
	for _, ex := range exs {
		defer e.release(ex)
	}

	// Only a server that does not answer abandons fn, and so drops the mount: a call is
	// waited for the operation timeout whatever its caller does; a copy, for the operation
	// timeout after it was told to stop (cancelled, or past its deadline), which it heeds
	// between files on a live server.
	timeout := e.timeout
	if copyTimeout > 0 {
		timeout = copyTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	mountCtx := ctx
	var wait context.Context
	var stopWait context.CancelFunc
	if copyTimeout > 0 {
		wait, stopWait = graceAfter(ctx, e.timeout)
		var cancelMount context.CancelFunc
		mountCtx, cancelMount = context.WithTimeout(ctx, e.timeout)
		defer cancelMount()
	} else {
		wait, stopWait = context.WithTimeout(context.WithoutCancel(ctx), e.timeout)
	}
	defer stopWait()
	roots := make([]*volume.Root, 0, len(exs))
	gens := make([]uint64, 0, len(exs))
	closeRoots := func() {
		for _, r := range roots {
			r.Close()
		}
	}
	sems := make([]*blocking.Slots, 0, len(exs))
	sources := make([]string, 0, len(exs))
	for _, ex := range exs {
		root, gen, err := e.acquire(mountCtx, ex)
		if err != nil {
			closeRoots()
			return err
		}
		sem := ex.sem
		if copyTimeout > 0 {
			sem = ex.copySem
		}
		roots, gens, sems, sources = append(roots, root), append(gens, gen), append(sems, sem), append(sources, ex.source)
	}
	err := boundedOn(ctx, wait, sems, "NFS "+strings.Join(sources, " and "), func() error {
		defer closeRoots()
		return fn(ctx, roots)
	})
	if errors.Is(err, errNoSlot) {
		// fn never ran. The calls holding the slots are slow or stuck, and those stuck
		// dropped the mount already when they were abandoned.
		closeRoots()
		return err
	}
	if isBrokenMount(err) {
		logger := klog.FromContext(ctx)
		for i, ex := range exs {
			logger.Info("Dropping NFS mount after error; the next call mounts again", "export", ex.source, "err", err)
			// In the background: unmounting from a hung server takes up to another timeout,
			// and the caller's deadline has passed already. The next mount waits for it on
			// ex.lock.
			gen := gens[i]
			e.mu.Lock()
			e.background(&e.running, func() { e.unmount(logger, ex, gen, false) })
			e.mu.Unlock()
		}
	}
	return err
}

// release ends a use of the export that run or a background delete began.
func (e *Exports) release(ex *export) {
	e.mu.Lock()
	ex.users--
	ex.lastUsed = time.Now()
	e.mu.Unlock()
}

func isBrokenMount(err error) bool {
	return errors.Is(err, ErrUnresponsive) || errors.Is(err, unix.ESTALE) ||
		errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.EIO)
}
