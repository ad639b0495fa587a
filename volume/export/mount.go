package export

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/internal/blocking"
	"github.com/dirpv/dirpv/internal/unmount"
	"github.com/dirpv/dirpv/volume"
)

// locked records that the caller just took ex.lock.
func (ex *export) locked() { ex.lockedSince.Store(time.Now().UnixNano()) }

// unlock releases ex.lock.
func (ex *export) unlock() {
	ex.lockedSince.Store(0)
	<-ex.lock
}

// acquire returns a handle on the export's root, which the caller closes, and the mount's
// generation, mounting the export if it is not mounted.
func (e *Exports) acquire(ctx context.Context, ex *export) (*volume.Root, uint64, error) {
	for mounted := false; ; mounted = true {
		select {
		case ex.lock <- struct{}{}:
			ex.locked()
		case <-ctx.Done():
			return nil, 0, fmt.Errorf("waiting to mount NFS %s: %w (%w)", ex.source, ErrUnresponsive, ctx.Err())
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
			return nil, 0, fmt.Errorf("NFS %s was dropped right after it was mounted: %w", ex.source, ErrUnresponsive)
		}
		if err := e.mountLocked(ctx, ex); err != nil {
			return nil, 0, err
		}
	}
}

// mountLocked mounts the export; the caller holds ex.lock, which mountLocked releases.
func (e *Exports) mountLocked(ctx context.Context, ex *export) error {
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
		// ex.lock: Close may have unmounted everything since. Checked here, under ex.lock,
		// which Close's unmount takes too, no mount starts after that unmount.
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
func (e *Exports) unmount(logger klog.Logger, ex *export, gen uint64, idleOnly bool) {
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
func (e *Exports) unmountDir(logger klog.Logger, ex *export) (how string, err error) {
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
func (e *Exports) forceUnmountDir(logger klog.Logger, ex *export) (how string, err error) {
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
func (e *Exports) dropLeftoverMount(logger klog.Logger, ex *export) error {
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

// Sweep starts unmounting the exports that nobody used for idle, each in its own goroutine,
// so that one whose server is dead holds up neither the others nor the caller.
func (e *Exports) Sweep(ctx context.Context, idle time.Duration) {
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

// Close unmounts every export, for shutdown; later calls are refused. Background deletes
// stop at their next step and carry on after a restart. It returns within about the operation
// timeout plus two lazy unmount timeouts, whatever the servers do.
func (e *Exports) Close(ctx context.Context) {
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
	blocking.WaitGroup(&e.walking, time.After(e.timeout/4))
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
	if !blocking.WaitGroup(&e.running, deadline) {
		logger.Info("Shutting down with NFS exports still unmounting: their servers do not answer")
	}
}
