package provisioner

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
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
	"github.com/dirpv/dirpv/internal/unmount"
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

// errExportUnresponsive marks calls abandoned because the NFS server did not answer in time.
var errExportUnresponsive = errors.New("NFS server did not answer in time")

// errNoSlot marks calls that never ran because the export's cap was full until the deadline.
var errNoSlot = errors.New("earlier calls are still waiting for the server")

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
			return fmt.Errorf("%s: %d %w: %w (%w)", what, sem.Size(), errNoSlot, errExportUnresponsive, err)
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
		return fmt.Errorf("%s: %w (%w)", what, errExportUnresponsive, context.Cause(wait))
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

// errShuttingDown refuses calls that arrive after the exports were released for shutdown.
var errShuttingDown = errors.New("dirpv controller is shutting down")

// exportKey identifies one controller-side mount: a mount per (server, share, options), since
// classes that differ in mount options must not share a mount.
func exportKey(server, share string, options []string) string {
	opts := slices.Clone(options)
	slices.Sort(opts)
	return volume.ExportSource(server, share) + " " + strings.Join(opts, ",")
}

// exports keeps one mount of each NFS export the controller serves, under workDir, unmounts
// those left unused, and removes deleted volumes in the background (trash.go).
type exports struct {
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

func newExports(mounter mount.Interface, workDir string, timeout time.Duration) *exports {
	bg, stop := context.WithCancel(context.Background())
	return &exports{mounter: mounter, workDir: workDir, timeout: timeout, logger: klog.Background(),
		bg: bg, stopBg: stop, byKey: map[string]*export{}}
}

// locked records that the caller just took ex.lock.
func (ex *export) locked() { ex.lockedSince.Store(time.Now().UnixNano()) }

// unlock releases ex.lock.
func (ex *export) unlock() {
	ex.lockedSince.Store(0)
	<-ex.lock
}

// get returns the export for (server, share, options), creating its record on first use.
func (e *exports) get(server, share string, options []string) *export {
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

// background runs fn in a goroutine that closeAll waits for, unless shutdown began. The
// caller holds e.mu.
func (e *exports) background(wg *sync.WaitGroup, fn func()) bool {
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

// do runs fn on the export's root, mounting the export first if needed. fn runs under the
// operation timeout; if the server does not answer, or answers that the mount went stale,
// the mount is dropped so the next call mounts afresh once the server is back.
func (e *exports) do(ctx context.Context, server, share string, options []string, fn func(*volume.Root) error) error {
	return e.run(ctx, e.get(server, share, options), fn)
}

func (e *exports) run(ctx context.Context, ex *export, fn func(*volume.Root) error) error {
	return e.runOn(ctx, 0, []*export{ex}, func(_ context.Context, roots []*volume.Root) error { return fn(roots[0]) })
}

// exportRef names one export a call needs.
type exportRef struct {
	server, share string
	options       []string
}

// doPair runs fn, a copy from one export to another, on the roots of both, a's first,
// mounting them first if needed, under timeout rather than the operation timeout: a copy
// takes as long as its tree. Mounting is still bounded by the operation timeout. When a and
// b are one export, fn gets its root twice and the call takes one slot.
func (e *exports) doPair(ctx context.Context, timeout time.Duration, a, b exportRef, fn func(ctx context.Context, ra, rb *volume.Root) error) error {
	exA, exB := e.get(a.server, a.share, a.options), e.get(b.server, b.share, b.options)
	if exA == exB {
		return e.runOn(ctx, timeout, []*export{exA}, func(ctx context.Context, roots []*volume.Root) error {
			return fn(ctx, roots[0], roots[0])
		})
	}
	// Slots are taken in the order of the exports' keys, whichever is the source, so that
	// clones running both ways between two exports never hold one slot each while waiting
	// for the other's.
	exs, swapped := []*export{exA, exB}, false
	if exportKey(a.server, a.share, a.options) > exportKey(b.server, b.share, b.options) {
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
// timeout; or, if copyTimeout is set, fn is a copy (doPair), which stops when its ctx ends,
// and gets copyTimeout and the export's copy slots.
func (e *exports) runOn(ctx context.Context, copyTimeout time.Duration, exs []*export, fn func(context.Context, []*volume.Root) error) error {
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
func (e *exports) release(ex *export) {
	e.mu.Lock()
	ex.users--
	ex.lastUsed = time.Now()
	e.mu.Unlock()
}

func isBrokenMount(err error) bool {
	return errors.Is(err, errExportUnresponsive) || errors.Is(err, unix.ESTALE) ||
		errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.EIO)
}

// acquire returns a handle on the export's root, which the caller closes, and the mount's
// generation, mounting the export if it is not mounted.
func (e *exports) acquire(ctx context.Context, ex *export) (*volume.Root, uint64, error) {
	for mounted := false; ; mounted = true {
		select {
		case ex.lock <- struct{}{}:
			ex.locked()
		case <-ctx.Done():
			return nil, 0, fmt.Errorf("waiting to mount NFS %s: %w (%w)", ex.source, errExportUnresponsive, ctx.Err())
		}
		if ex.root != nil {
			root, err := ex.root.Dup()
			gen := ex.gen
			ex.unlock()
			return root, gen, err
		}
		if mounted {
			// Unmounted again between our mount and now: the server just failed someone else.
			ex.unlock()
			return nil, 0, fmt.Errorf("NFS %s was dropped right after it was mounted: %w", ex.source, errExportUnresponsive)
		}
		if err := e.mountLocked(ctx, ex); err != nil {
			return nil, 0, err
		}
	}
}

// mountLocked mounts the export; the caller holds ex.lock, which mountLocked releases.
func (e *exports) mountLocked(ctx context.Context, ex *export) error {
	logger := klog.FromContext(ctx)
	// The mount runs in bounded's goroutine, which may outlive our deadline. Once started, it
	// keeps ex.lock until it is done and stores the root itself, so that a mount finishing
	// after we gave up is adopted by the next call. Left with nobody owning its open root,
	// it would make every later unmount of ex.dir fail ("target is busy") and the export
	// could not be mounted again; and no second mount can start on ex.dir meanwhile.
	var (
		mu               sync.Mutex
		started, gaveUp  bool
		errGaveUpEarlier = errors.New("caller gave up before the mount started")
	)
	err := bounded(ctx, ex.sem, "mount NFS "+ex.source, func() error {
		mu.Lock()
		if gaveUp {
			mu.Unlock()
			return errGaveUpEarlier
		}
		started = true
		mu.Unlock()
		defer ex.unlock()
		if err := os.MkdirAll(ex.dir, 0o700); err != nil {
			return fmt.Errorf("create mount point: %w", err)
		}
		// A mount left by an earlier run of dirpv may be stale; mount afresh rather than trust
		// it. Found in the mount table, which never waits on a server, and taken down with the
		// bounded forced and lazy unmounts: a stat or umount(8) of a stale hard mount would
		// hang with ex.lock held.
		if err := e.dropLeftoverMount(logger, ex); err != nil {
			return err
		}
		if err := os.MkdirAll(ex.dir, 0o700); err != nil {
			return fmt.Errorf("create mount point: %w", err)
		}
		// A background delete checks for shutdown before it acquires the export, without
		// ex.lock: closeAll may have unmounted everything since. Checked here, under ex.lock,
		// which closeAll's unmount takes too, no mount starts after that unmount.
		e.mu.Lock()
		closed := e.closed
		e.mu.Unlock()
		if closed {
			return fmt.Errorf("mount NFS %s: %w", ex.source, errShuttingDown)
		}
		start := time.Now()
		if err := e.mounter.Mount(ex.source, ex.dir, "nfs", ex.options); err != nil {
			return fmt.Errorf("mount NFS %s with options %q: %w", ex.source, ex.options, err)
		}
		r, err := volume.OpenRoot(ex.dir)
		if err != nil {
			return err
		}
		ex.root = r
		ex.gen++
		logger.Info("Mounted NFS export", "export", ex.source, "options", ex.options, "dir", ex.dir, "duration", time.Since(start))
		// Volumes deleted before a restart, or whose removal stopped with the mount, are
		// still in the trash: carry on with them. Listed on the mount just made, through a
		// handle of its own, so that the listing never mounts again by itself; and after
		// ex.lock is released, so that a server slow to list holds up no other call.
		trashRoot, derr := r.Dup()
		e.mu.Lock()
		ex.mounted = true
		if derr != nil {
			logger.Error(derr, "Resuming the removal of deleted volumes", "export", ex.source)
		} else if !e.background(&e.running, func() {
			defer trashRoot.Close()
			e.resumeTrash(e.logger, ex, trashRoot)
		}) {
			trashRoot.Close()
		}
		e.mu.Unlock()
		return nil
	})
	if err != nil {
		mu.Lock()
		gaveUp = true
		if !started {
			ex.unlock()
		}
		mu.Unlock()
	}
	return err
}

// unmount drops the export's mount if it is still mount gen (0: whichever is mounted) and,
// with idleOnly, if nobody uses the export. Every step is bounded, so a dead server never
// wedges the caller: waiting for ex.lock and the plain unmount by the operation timeout, the
// forced and the lazy unmount by unmount.LazyTimeout.
func (e *exports) unmount(logger klog.Logger, ex *export, gen uint64, idleOnly bool) {
	select {
	case ex.lock <- struct{}{}:
		ex.locked()
	case <-time.After(e.timeout):
		logger.Info("Gave up unmounting NFS export: a mount of it is still under way", "export", ex.source, "dir", ex.dir)
		return
	}
	defer ex.unlock()
	if ex.root == nil || (gen != 0 && gen != ex.gen) {
		return
	}
	e.mu.Lock()
	busy := idleOnly && ex.users > 0
	if !busy {
		ex.mounted = false
	}
	e.mu.Unlock()
	if busy {
		return
	}
	// Callers hold their own duplicates: closing ours only ends the mount's own hold on it.
	ex.root.Close()
	ex.root = nil
	how, err := e.unmountDir(logger, ex)
	if err != nil {
		logger.Error(err, "Unmounting NFS export", "export", ex.source, "dir", ex.dir)
		return
	}
	logger.Info("Unmounted NFS export", "export", ex.source, "dir", ex.dir, "unmount", how)
}

// unmountDir unmounts ex.dir: through the mounter, then, if that fails or hangs, with
// MNT_FORCE (which aborts requests still waiting on a dead NFS server) and last with
// MNT_DETACH, which takes the mount out of the tree at once and lets it go when its last
// user (an abandoned call, a handle still held) is done.
func (e *exports) unmountDir(logger klog.Logger, ex *export) (how string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	err = bounded(ctx, ex.sem, "unmount "+ex.dir, func() error { return e.mounter.Unmount(ex.dir) })
	if err == nil {
		removeMountPoint(logger, ex.dir)
		return "plain", nil
	}
	logger.Info("Unmount failed or does not finish; forcing it", "export", ex.source, "dir", ex.dir, "reason", err)
	how, ferr := e.forceUnmountDir(logger, ex)
	if ferr != nil {
		return "", errors.Join(err, ferr)
	}
	return how, nil
}

// forceUnmountDir unmounts ex.dir with MNT_FORCE, then with MNT_DETACH, each bounded by
// unmount.LazyTimeout and taking a slot of ex.forceSem, neither waiting on the server.
func (e *exports) forceUnmountDir(logger klog.Logger, ex *export) (how string, err error) {
	timeout := min(e.timeout, unmount.LazyTimeout)
	how, err = unmount.ForceThenLazy(klog.NewContext(context.Background(), logger), ex.dir, unmount.Force(ex.dir), timeout, timeout,
		func(ctx context.Context, timeout time.Duration, what string, fn func() error) error {
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			return bounded(ctx, ex.forceSem, what, fn)
		})
	if err == nil {
		removeMountPoint(logger, ex.dir)
	}
	return how, err
}

// dropLeftoverMount unmounts whatever is mounted at ex.dir, which this process has not mounted
// (the caller holds ex.lock and ex.root is nil): a mount left by an earlier run.
func (e *exports) dropLeftoverMount(logger klog.Logger, ex *export) error {
	mps, err := e.mounter.List()
	if err != nil {
		return fmt.Errorf("list mounts: %w", err)
	}
	if !slices.ContainsFunc(mps, func(mp mount.MountPoint) bool { return mp.Path == ex.dir }) {
		return nil
	}
	how, err := e.forceUnmountDir(logger, ex)
	if err != nil {
		return fmt.Errorf("clean up earlier mount at %s: %w", ex.dir, err)
	}
	logger.Info("Unmounted a mount left by an earlier run", "export", ex.source, "dir", ex.dir, "unmount", how)
	return nil
}

// removeMountPoint removes the now empty mount point; a later mount makes it again.
func removeMountPoint(logger klog.Logger, dir string) {
	if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		logger.V(4).Info("Mount point stays", "dir", dir, "err", err)
	}
}

// sweep starts unmounting the exports that nobody used for idle, each in its own goroutine,
// so that one whose server is dead holds up neither the others nor the caller.
func (e *exports) sweep(ctx context.Context, idle time.Duration) {
	logger := klog.FromContext(ctx)
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, ex := range e.byKey {
		if !ex.mounted || ex.unmounting || ex.users > 0 || time.Since(ex.lastUsed) <= idle {
			continue
		}
		ex.unmounting = true
		e.background(&e.running, func() {
			e.unmount(logger, ex, 0, true)
			e.mu.Lock()
			ex.unmounting = false
			e.mu.Unlock()
		})
	}
}

// closeAll unmounts every export, for shutdown; later calls are refused. Background deletes
// stop at their next step and carry on after a restart. It returns within about the operation
// timeout plus two lazy unmount timeouts, whatever the servers do.
func (e *exports) closeAll(ctx context.Context) {
	logger := klog.FromContext(ctx)
	deadline := time.After(e.timeout + 2*min(e.timeout, unmount.LazyTimeout))
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	// From here on no call starts and nothing new runs in the background.
	e.closed = true
	e.stopBg()
	e.mu.Unlock()
	// Give walks a moment to stop at a step boundary, so their exports unmount cleanly.
	waitGroup(&e.walking, time.After(e.timeout/4))
	e.mu.Lock()
	for _, ex := range e.byKey {
		if ex.mounted && !ex.unmounting {
			ex.unmounting = true
			e.running.Add(1)
			go func() {
				defer e.running.Done()
				e.unmount(logger, ex, 0, false)
			}()
		}
	}
	e.mu.Unlock()
	if !waitGroup(&e.running, deadline) {
		logger.Info("Shutting down with NFS exports still unmounting: their servers do not answer")
	}
}

// waitGroup waits for wg until deadline fires, and reports whether wg finished.
func waitGroup(wg *sync.WaitGroup, deadline <-chan time.Time) bool {
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

// localRoots keeps the base directories of local classes open, and makes sure each is still
// the file system its volumes are on (volume.BaseRecords).
type localRoots struct {
	// records are the bases' identities (role node; nil: unchecked, for tests of other parts).
	records *volume.BaseRecords

	mu     sync.Mutex
	byBase map[string]*volume.Root
	// retired are roots replaced because their path moved (Moved); other calls may still be
	// using them, so they are closed with the rest.
	retired []*volume.Root
}

// do runs fn on the root of basePath, which is allowed or beneath allowed. The allowed base
// is the admin's (set by flag) and may be reached through symlinks; basePath is opened beneath
// it without following any, and both are created on first use. A root whose path has moved
// since (an admin mounted the disk meant for the base after the class was first used, say) is
// opened again, so that volumes go where the path leads now. A base that held volumes is
// never created, and must still be the file system it was (volume.ErrBaseChanged otherwise).
func (l *localRoots) do(allowed, basePath string, fn func(*volume.Root) error) error {
	l.mu.Lock()
	root, ok := l.byBase[basePath]
	if ok {
		if moved, err := root.Moved(); err != nil || moved {
			l.retired = append(l.retired, root)
			delete(l.byBase, basePath)
			ok = false
		}
	}
	if !ok {
		held := false
		if l.records != nil {
			var err error
			if held, err = l.records.Held(basePath); err != nil {
				l.mu.Unlock()
				return fmt.Errorf("%w: %w", errBaseUnusable, err)
			}
		}
		var err error
		if root, err = openLocalBase(allowed, basePath, !held); err != nil {
			l.mu.Unlock()
			if held && isNotExist(err) {
				return fmt.Errorf("base path %s is %w: it held volumes but is gone (%w); the disk meant to be mounted at or above it "+
					"is probably not mounted. dirpv creates and deletes no volume there until it is back, and carries on by itself then. "+
					"If the base was removed on purpose, remove %s on this node",
					basePath, volume.ErrBaseChanged, err, l.records.RecordPath(basePath))
			}
			return fmt.Errorf("%w: %w", errBaseUnusable, err)
		}
		if l.byBase == nil {
			l.byBase = map[string]*volume.Root{}
		}
		l.byBase[basePath] = root
	}
	l.mu.Unlock()
	if l.records != nil {
		if err := l.records.Check(basePath, root); err != nil {
			if errors.Is(err, volume.ErrBaseChanged) {
				return err
			}
			return fmt.Errorf("%w: %w", errBaseUnusable, err)
		}
	}
	return fn(root)
}

// held records that basePath holds a volume, so that it must keep its identity from now on.
func (l *localRoots) held(basePath string) error {
	if l.records == nil {
		return nil
	}
	return l.records.MarkHeld(basePath)
}

// openLocalBase opens basePath beneath allowed, making both first with create.
func openLocalBase(allowed, basePath string, create bool) (*volume.Root, error) {
	if create {
		if err := os.MkdirAll(allowed, 0o755); err != nil {
			return nil, fmt.Errorf("create allowed base path: %w", err)
		}
	}
	top, err := volume.OpenRoot(allowed)
	if err != nil {
		return nil, err
	}
	defer top.Close()
	rel, err := filepath.Rel(allowed, basePath)
	if err != nil {
		return nil, fmt.Errorf("base path %s beneath %s: %w", basePath, allowed, err)
	}
	if rel == "." {
		rel = ""
	}
	root, err := top.OpenSubRoot(rel, create)
	if err != nil {
		return nil, fmt.Errorf("open base path: %w", err)
	}
	return root, nil
}

func (l *localRoots) closeAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for base, root := range l.byBase {
		root.Close()
		delete(l.byBase, base)
	}
	for _, root := range l.retired {
		root.Close()
	}
	l.retired = nil
}
