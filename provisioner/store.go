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
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// maxStuckCalls caps the calls that may wait on one NFS export at once. A call on a dead NFS
// server blocks in the kernel and cannot be cancelled, only abandoned; the cap makes a dead
// server cost a fixed number of goroutines instead of one per retry.
const maxStuckCalls = 8

// errExportUnresponsive marks calls abandoned because the NFS server did not answer in time.
var errExportUnresponsive = errors.New("NFS server did not answer in time")

// bounded runs fn and waits for it until ctx is done. sem limits how many fn may be running,
// abandoned ones included.
func bounded(ctx context.Context, sem *callSlots, what string, fn func() error) error {
	slot, err := sem.acquire(ctx)
	if err != nil {
		return fmt.Errorf("%s: %d earlier calls are still waiting for the server: %w (%w)", what, sem.size(), errExportUnresponsive, err)
	}
	done := make(chan error, 1)
	go func() {
		defer slot.release()
		done <- fn()
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		slot.abandon()
		return fmt.Errorf("%s: %w (%w)", what, errExportUnresponsive, ctx.Err())
	}
}

// exportKey identifies one controller-side mount: a mount per (server, share, options), since
// classes that differ in mount options must not share a mount.
func exportKey(server, share string, options []string) string {
	opts := slices.Clone(options)
	slices.Sort(opts)
	return volume.ExportSource(server, share) + " " + strings.Join(opts, ",")
}

// exports keeps one mount of each NFS export the controller serves, under workDir, and
// unmounts those left unused.
type exports struct {
	mounter mount.Interface
	workDir string
	timeout time.Duration

	mu    sync.Mutex
	byKey map[string]*export
}

type export struct {
	source  string
	options []string
	dir     string
	sem     *callSlots
	// lock serialises mounting and unmounting; a channel so that waiters honour their deadline.
	lock     chan struct{}
	root     *volume.Root
	users    int
	lastUsed time.Time
}

func newExports(mounter mount.Interface, workDir string, timeout time.Duration) *exports {
	return &exports{mounter: mounter, workDir: workDir, timeout: timeout, byKey: map[string]*export{}}
}

// do runs fn on the export's root, mounting the export first if needed. fn runs under the
// operation timeout; if the server does not answer, or answers that the mount went stale,
// the mount is dropped so the next call mounts afresh once the server is back.
func (e *exports) do(ctx context.Context, server, share string, options []string, fn func(*volume.Root) error) error {
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	key := exportKey(server, share, options)
	e.mu.Lock()
	ex, ok := e.byKey[key]
	if !ok {
		sum := sha256.Sum256([]byte(key))
		ex = &export{
			source:  volume.ExportSource(server, share),
			options: slices.Clone(options),
			dir:     filepath.Join(e.workDir, "exports", hex.EncodeToString(sum[:8])),
			sem:     newCallSlots(maxStuckCalls),
			lock:    make(chan struct{}, 1),
		}
		e.byKey[key] = ex
	}
	ex.users++
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		ex.users--
		ex.lastUsed = time.Now()
		e.mu.Unlock()
	}()

	root, err := e.mountLocked(ctx, ex)
	if err != nil {
		return err
	}
	err = bounded(ctx, ex.sem, "NFS "+ex.source, func() error { return fn(root) })
	if isBrokenMount(err) {
		klog.FromContext(ctx).Info("Dropping NFS mount after error; the next call mounts again", "export", ex.source, "err", err)
		// In the background: unmounting from a hung server takes up to another timeout, and
		// the caller's deadline has passed already. The next mount waits for it on ex.lock.
		go e.unmount(context.WithoutCancel(ctx), ex, root)
	}
	return err
}

func isBrokenMount(err error) bool {
	return errors.Is(err, errExportUnresponsive) || errors.Is(err, unix.ESTALE) ||
		errors.Is(err, unix.ENOTCONN) || errors.Is(err, unix.EIO)
}

// mountLocked returns the export's root, mounting it if it is not mounted.
func (e *exports) mountLocked(ctx context.Context, ex *export) (*volume.Root, error) {
	select {
	case ex.lock <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting to mount NFS %s: %w (%w)", ex.source, errExportUnresponsive, ctx.Err())
	}
	if ex.root != nil {
		root := ex.root
		<-ex.lock
		return root, nil
	}
	logger := klog.FromContext(ctx)
	// The mount runs in bounded's goroutine, which may outlive our deadline. Once started, it
	// keeps ex.lock until it is done and stores the root itself, so that a mount finishing
	// after we gave up is adopted by the next call. Left with nobody owning its open root,
	// it would make every later unmount of ex.dir fail ("target is busy") and the export
	// could not be mounted again; and no second mount can start on ex.dir meanwhile.
	var (
		mu               sync.Mutex
		started, gaveUp  bool
		root             *volume.Root
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
		defer func() { <-ex.lock }()
		if err := os.MkdirAll(ex.dir, 0o700); err != nil {
			return fmt.Errorf("create mount point: %w", err)
		}
		// A mount left by an earlier run of dirpv may be stale; mount afresh rather than trust it.
		if err := mount.CleanupMountPoint(ex.dir, e.mounter, true); err != nil {
			return fmt.Errorf("clean up earlier mount at %s: %w", ex.dir, err)
		}
		if err := os.MkdirAll(ex.dir, 0o700); err != nil {
			return fmt.Errorf("create mount point: %w", err)
		}
		start := time.Now()
		if err := e.mounter.Mount(ex.source, ex.dir, "nfs", ex.options); err != nil {
			return fmt.Errorf("mount NFS %s with options %q: %w", ex.source, ex.options, err)
		}
		r, err := volume.OpenRoot(ex.dir)
		if err != nil {
			return err
		}
		root, ex.root = r, r
		logger.Info("Mounted NFS export", "export", ex.source, "options", ex.options, "dir", ex.dir, "duration", time.Since(start))
		return nil
	})
	if err != nil {
		mu.Lock()
		gaveUp = true
		if !started {
			<-ex.lock
		}
		mu.Unlock()
		return nil, err
	}
	return root, nil
}

// unmount drops the export's mount if root is still the current one. It gives up waiting
// after the operation timeout and falls back to a lazy unmount, since the server may be dead.
func (e *exports) unmount(ctx context.Context, ex *export, root *volume.Root) {
	select {
	case ex.lock <- struct{}{}:
	case <-time.After(e.timeout):
		return
	}
	defer func() { <-ex.lock }()
	if ex.root == nil || ex.root != root {
		return
	}
	ex.root.Close()
	ex.root = nil
	logger := klog.FromContext(ctx)
	if err := unmountWithForce(e.mounter, ex.dir, e.timeout); err != nil {
		logger.Error(err, "Unmounting NFS export", "export", ex.source, "dir", ex.dir)
		return
	}
	logger.Info("Unmounted NFS export", "export", ex.source, "dir", ex.dir)
}

// unmountWithForce unmounts dir, lazily if a plain unmount does not finish within timeout, so
// that a dead server never wedges the caller.
func unmountWithForce(mounter mount.Interface, dir string, timeout time.Duration) error {
	if fm, ok := mounter.(mount.MounterForceUnmounter); ok {
		return mount.CleanupMountWithForce(dir, fm, false, timeout)
	}
	return mount.CleanupMountPoint(dir, mounter, false)
}

// sweep unmounts exports that nobody used for idle.
func (e *exports) sweep(ctx context.Context, idle time.Duration) {
	e.mu.Lock()
	var stale []*export
	for key, ex := range e.byKey {
		if ex.users == 0 && time.Since(ex.lastUsed) > idle {
			stale = append(stale, ex)
			delete(e.byKey, key)
		}
	}
	e.mu.Unlock()
	for _, ex := range stale {
		e.unmount(ctx, ex, ex.root)
	}
}

// closeAll unmounts every export, for shutdown.
func (e *exports) closeAll(ctx context.Context) {
	e.sweep(ctx, -1)
}

// localRoots keeps the base directories of local classes open.
type localRoots struct {
	mu     sync.Mutex
	byBase map[string]*volume.Root
}

func (l *localRoots) do(basePath string, fn func(*volume.Root) error) error {
	l.mu.Lock()
	root, ok := l.byBase[basePath]
	if !ok {
		// The base belongs to the admin, who named it in the class; dirpv creates it on first use.
		if err := os.MkdirAll(basePath, 0o755); err != nil {
			l.mu.Unlock()
			return fmt.Errorf("create base path: %w", err)
		}
		var err error
		if root, err = volume.OpenRoot(basePath); err != nil {
			l.mu.Unlock()
			return err
		}
		if l.byBase == nil {
			l.byBase = map[string]*volume.Root{}
		}
		l.byBase[basePath] = root
	}
	l.mu.Unlock()
	return fn(root)
}

func (l *localRoots) closeAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for base, root := range l.byBase {
		root.Close()
		delete(l.byBase, base)
	}
}
