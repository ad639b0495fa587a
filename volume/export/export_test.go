package export

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/internal/unmount"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export/exporttest"
)

// slowMounter is a FakeMounter whose Mount blocks until release is closed, like mount(8)
// against a server that answers only after the caller's deadline.
type slowMounter struct {
	*mount.FakeMounter
	release chan struct{}
	mounts  atomic.Int32
}

func (m *slowMounter) Mount(source, target, fstype string, options []string) error {
	m.mounts.Add(1)
	<-m.release
	return m.FakeMounter.Mount(source, target, fstype, options)
}

// A mount that completes after its caller gave up is adopted by the next call: neither left
// mounted with an open root nobody closes (which made every later unmount fail with "target is
// busy" on a real NFS mount), nor mounted a second time on top. While it hangs it holds the
// export's mount lock, so every later call waits for it in vain while only one of the export's
// call slots is taken: the controller turns unhealthy once the lock has been held longer than
// the limit, and healthy again once the mount returns.
func TestLateMountIsAdopted(t *testing.T) {
	m := &slowMounter{FakeMounter: mount.NewFakeMounter(nil), release: make(chan struct{})}
	e := New(m, t.TempDir(), 200*time.Millisecond)
	t.Cleanup(func() { e.Close(context.Background()) })
	released := false
	t.Cleanup(func() {
		if !released {
			close(m.release)
		}
	})
	noop := func(*volume.Root) error { return nil }
	const limit = 400 * time.Millisecond

	err := e.Do(context.Background(), "nfs.example", "/export", []string{"nolock"}, noop)
	if !errors.Is(err, ErrUnresponsive) {
		t.Fatalf("first call against a hung mount: %v, want ErrUnresponsive", err)
	}
	// While the abandoned mount is still running, a second call must not start another.
	err = e.Do(context.Background(), "nfs.example", "/export", []string{"nolock"}, noop)
	if !errors.Is(err, ErrUnresponsive) {
		t.Fatalf("call while the first mount still runs: %v, want ErrUnresponsive", err)
	}
	eventually(t, 5*time.Second, func() (bool, string) {
		err := e.Healthy(limit)
		return err != nil && strings.Contains(err.Error(), "nfs.example:/export (mount lock held since"),
			fmt.Sprintf("while the mount hangs: %v, want unhealthy for the held mount lock", err)
	})
	close(m.release)
	released = true
	eventually(t, 5*time.Second, func() (bool, string) {
		err := e.Healthy(limit)
		return err == nil, fmt.Sprintf("once the mount returned: %v, want healthy", err)
	})
	err = e.Do(context.Background(), "nfs.example", "/export", []string{"nolock"}, noop)
	if err != nil {
		t.Fatalf("call after the server answered: %v", err)
	}
	if n := m.mounts.Load(); n != 1 {
		t.Errorf("Mount called %d times, want 1: the late mount should be adopted", n)
	}
	if mps, _ := m.List(); len(mps) != 1 {
		t.Errorf("mounts: %v, want exactly one", mps)
	}
}

// Test helpers shared with the tests of the packages above (provisioner).
var (
	newBindMounter = exporttest.NewBindMounter
	isMounted      = exporttest.IsMounted
	eventually     = exporttest.Eventually
)

// bindExport serves server:share from a directory of its own (src) through Exports with the
// operation timeout, closed at the test's end, and returns them and the export's mount point.
func bindExport(t *testing.T, server, share string, timeout time.Duration) (m *exporttest.BindMounter, e *Exports, src, dir string) {
	t.Helper()
	m = newBindMounter(t)
	src = m.Export(t, server, share)
	e = New(m, t.TempDir(), timeout)
	t.Cleanup(func() { e.Close(context.Background()) })
	return m, e, src, exportDir(e, server, share)
}

// exportDir returns the mount point of server:share under e's work dir.
func exportDir(e *Exports, server, share string) string {
	return e.get(server, share, nil).dir
}

// A call holding the export's root keeps a working root when the mount is dropped under it
// (another call failed with EIO): it goes on creating in the same export, not through a
// closed or reused descriptor, and the mount itself is gone at once (detached lazily, since
// the call keeps it busy).
func TestRootInUseSurvivesUnmount(t *testing.T) {
	m, e, src, dir := bindExport(t, "nfs.example", "/a", 2*time.Second)

	entered, proceed := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		held <- e.Do(context.Background(), "nfs.example", "/a", nil, func(root *volume.Root) error {
			close(entered)
			<-proceed
			_, err := root.MkdirAll("made-after-unmount", volume.Owner{Mode: 0o755, UID: -1, GID: -1}, volume.Claim{UID: "uid-late", PVName: "pv-late"})
			return err
		})
	}()
	<-entered
	err := e.Do(context.Background(), "nfs.example", "/a", nil, func(*volume.Root) error { return unix.EIO })
	if !errors.Is(err, unix.EIO) {
		t.Fatalf("failing call: %v, want EIO", err)
	}
	eventually(t, 10*time.Second, func() (bool, string) {
		return !isMounted(dir), "the export is still mounted after the call that failed with EIO"
	})
	// Descriptors opened now may get the number the unmount freed.
	for range 4 {
		f, err := os.Open(t.TempDir())
		must(t, err)
		defer f.Close()
	}
	close(proceed)
	if err := <-held; err != nil {
		t.Fatalf("call that held the root across the unmount: %v", err)
	}
	if _, err := os.Stat(filepath.Join(src, "made-after-unmount")); err != nil {
		t.Errorf("directory made through the held root is not in the export: %v", err)
	}
	// The next call mounts afresh and sees it.
	err = e.Do(context.Background(), "nfs.example", "/a", nil, func(root *volume.Root) error {
		_, err := root.Stat("made-after-unmount")
		return err
	})
	if err != nil {
		t.Errorf("call after the remount: %v", err)
	}
	if n := m.Mounts.Load(); n != 2 {
		t.Errorf("mounted %d times, want 2", n)
	}
}

// An export whose unmount hangs (dead server) holds up neither the sweep that started it,
// nor the idle unmount of another export, nor shutdown beyond its bound; after shutdown no
// call mounts it again.
func TestHungUnmountBlocksNeitherSweepNorShutdown(t *testing.T) {
	const timeout = time.Second
	m := newBindMounter(t)
	m.Export(t, "dead.example", "/x")
	m.Export(t, "live.example", "/y")
	e := New(m, t.TempDir(), timeout)
	dead, live := exportDir(e, "dead.example", "/x"), exportDir(e, "live.example", "/y")
	noop := func(*volume.Root) error { return nil }
	mountBoth := func() {
		t.Helper()
		must(t, e.Do(context.Background(), "dead.example", "/x", nil, noop))
		must(t, e.Do(context.Background(), "live.example", "/y", nil, noop))
	}
	m.HangUnmounts("dead.example", "/x")
	mountBoth()

	start := time.Now()
	e.Sweep(context.Background(), -1)
	if d := time.Since(start); d > timeout/2 {
		t.Errorf("sweep took %v: it waits for unmounts", d)
	}
	eventually(t, timeout/2, func() (bool, string) {
		return !isMounted(live), "the live export is still mounted while the dead one's unmount hangs"
	})
	// The hung plain unmount is given up after the timeout and forced.
	eventually(t, 3*timeout, func() (bool, string) {
		return !isMounted(dead), "the dead export is still mounted"
	})

	mountBoth()
	start = time.Now()
	e.Close(context.Background())
	bound := timeout + 2*min(timeout, unmount.LazyTimeout)
	if d := time.Since(start); d > bound+time.Second {
		t.Errorf("Close took %v with a hung unmount, bound %v", d, bound)
	}
	for _, dir := range []string{dead, live} {
		if isMounted(dir) {
			t.Errorf("%s is still mounted after Close", dir)
		}
	}
	if err := e.Do(context.Background(), "live.example", "/y", nil, noop); !errors.Is(err, errShuttingDown) {
		t.Errorf("call after Close: %v, want errShuttingDown", err)
	}
	// A background delete that passed its shutdown check just before Close acquires its export
	// after Close unmounted everything: it is refused, and nothing is mounted again behind
	// shutdown's back.
	root, _, err := e.acquire(context.Background(), e.get("live.example", "/y", nil))
	if root != nil {
		root.Close()
	}
	if !errors.Is(err, errShuttingDown) || isMounted(live) {
		t.Errorf("acquire after Close: %v (mounted: %t), want errShuttingDown and nothing mounted", err, isMounted(live))
	}
}

// When the plain unmount hangs and the mount is busy (an abandoned call still holds a file on
// it), the forced unmount fails too and the lazy one takes the mount away: nothing stays
// mounted, and unmount returns within its bound.
func TestLazyUnmountLeavesNoMount(t *testing.T) {
	const timeout = time.Second
	m, e, src, dir := bindExport(t, "dead.example", "/x", timeout)
	must(t, os.WriteFile(filepath.Join(src, "busy"), nil, 0o644))
	must(t, e.Do(context.Background(), "dead.example", "/x", nil, func(*volume.Root) error { return nil }))
	busy, err := os.Open(filepath.Join(dir, "busy"))
	must(t, err)
	defer busy.Close()
	m.HangUnmounts("dead.example", "/x")

	start := time.Now()
	e.unmount(klog.Background(), e.get("dead.example", "/x", nil), 0, false)
	if d, bound := time.Since(start), timeout+2*min(timeout, unmount.LazyTimeout); d > bound {
		t.Errorf("unmount took %v, bound %v", d, bound)
	}
	if isMounted(dir) {
		t.Fatalf("%s is still mounted after the lazy fallback", dir)
	}
	// The busy file still reads from the export, through the detached mount.
	if _, err := busy.Stat(); err != nil {
		t.Errorf("file held across the lazy unmount: %v", err)
	}
}

// A mount left at an export's mount point by an earlier run, whose server no longer answers
// (umount(8) hangs), is taken down with the bounded forced and lazy unmounts: the first call
// mounts afresh within its deadline instead of hanging with the export's lock held.
func TestLeftoverMountWithHungUnmountIsReplaced(t *testing.T) {
	m, e, data, dir := bindExport(t, "nfs.example", "/export", 2*time.Second)
	must(t, os.MkdirAll(dir, 0o700))
	must(t, m.Mount(volume.ExportSource("nfs.example", "/export"), dir, "nfs", nil))
	m.HangUnmounts("nfs.example", "/export")
	start := time.Now()
	err := e.Do(context.Background(), "nfs.example", "/export", nil, func(root *volume.Root) error {
		return root.Mkdir("made", 0o755)
	})
	if err != nil {
		t.Fatalf("first call with a leftover mount whose unmount hangs: %v (after %v)", err, time.Since(start))
	}
	if _, err := os.Stat(filepath.Join(data, "made")); err != nil {
		t.Errorf("the call did not reach the export: %v", err)
	}
	infos, _ := mount.ParseMountInfo("/proc/self/mountinfo")
	n := 0
	for _, mi := range infos {
		if mi.MountPoint == dir {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d mounts at %s, want exactly one (the leftover gone, a fresh one made)", n, dir)
	}
}

// longCopy stands in for a copy on a live server: it holds the roots, as a copy holds its
// open directories, until done is closed, or until told to stop, and then returns as a copy
// does between files.
func longCopy(started chan<- struct{}, done <-chan struct{}) func(ctx context.Context, _, _ *volume.Root) error {
	return func(ctx context.Context, _, _ *volume.Root) error {
		started <- struct{}{}
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			return fmt.Errorf("copy: %w", ctx.Err())
		}
	}
}

// A copy stopped on purpose (its snapshot deleted, its clone past --clone-timeout) is not a
// dead server: the copy's error comes back, the export stays mounted, and the next call uses
// the same mount.
func TestStoppedCopyKeepsTheExport(t *testing.T) {
	for _, tc := range []struct {
		name        string
		copyTimeout time.Duration
		cancel      bool
		want        error
	}{
		{"cancelled", time.Minute, true, context.Canceled},
		{"past its deadline", 100 * time.Millisecond, false, context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, e, _, dir := bindExport(t, "nfs.example", "/export", 5*time.Second)
			ref := Ref{"nfs.example", "/export", nil}
			// Mounted before the copy starts, so that the copy's short deadline can only
			// pass in the copy, never in the mount (which would read as a dead server).
			must(t, e.Do(context.Background(), "nfs.example", "/export", nil, func(*volume.Root) error { return nil }))

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			started := make(chan struct{}, 1)
			copied := make(chan error, 1)
			go func() { copied <- e.DoPair(ctx, tc.copyTimeout, ref, ref, longCopy(started, nil)) }()
			var err error
			select {
			case <-started:
				if tc.cancel {
					cancel()
				}
				err = <-copied
			case err = <-copied:
				// On a loaded machine the short deadline can pass before the copy begins
				// (its slot): a copy stopped by its deadline all the same.
			}
			if !errors.Is(err, tc.want) || errors.Is(err, ErrUnresponsive) {
				t.Fatalf("stopped copy: %v, want %v and not ErrUnresponsive", err, tc.want)
			}
			e.running.Wait() // any unmount the copy started
			if !isMounted(dir) {
				t.Fatal("the export was unmounted after a copy was stopped")
			}
			if err := e.Do(context.Background(), "nfs.example", "/export", nil, func(root *volume.Root) error {
				return root.Mkdir("after", 0o755)
			}); err != nil {
				t.Fatalf("call after the stopped copy: %v", err)
			}
			if n := m.Mounts.Load(); n != 1 {
				t.Errorf("mounted %d times, want 1", n)
			}
		})
	}
}

// More copies than an export has call slots neither hold up its other calls nor get it
// unmounted: copies have slots of their own, and one beyond them waits its turn.
func TestManyCopiesLeaveCallsAlone(t *testing.T) {
	const timeout = time.Second
	m, e, _, dir := bindExport(t, "nfs.example", "/export", timeout)
	ref := Ref{"nfs.example", "/export", nil}

	started, done := make(chan struct{}, maxCopies+1), make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, maxCopies+1)
	for range maxCopies + 1 {
		wg.Go(func() { errs <- e.DoPair(context.Background(), time.Minute, ref, ref, longCopy(started, done)) })
	}
	for range maxCopies {
		<-started
	}
	start := time.Now()
	if err := e.Do(context.Background(), "nfs.example", "/export", nil, func(root *volume.Root) error {
		return root.Mkdir("during", 0o755)
	}); err != nil {
		t.Errorf("call while %d copies run: %v", maxCopies+1, err)
	}
	if d := time.Since(start); d > timeout/2 {
		t.Errorf("call while %d copies run took %v", maxCopies+1, d)
	}
	// The copy beyond the slots gets one once another copy is done.
	close(done)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("copy: %v", err)
		}
	}
	e.running.Wait()
	if !isMounted(dir) {
		t.Error("the export was unmounted")
	}
	if n := m.Mounts.Load(); n != 1 {
		t.Errorf("mounted %d times, want 1", n)
	}
}

// A copy that does not stop when told to is stuck on its server: it is abandoned an
// operation timeout later, counted among the stuck calls, and the mount is dropped.
func TestCopyThatDoesNotStopIsAbandoned(t *testing.T) {
	const timeout = 200 * time.Millisecond
	_, e, _, dir := bindExport(t, "nfs.example", "/export", timeout)
	ref := Ref{"nfs.example", "/export", nil}

	answer := make(chan struct{})
	defer close(answer)
	ctx, cancel := context.WithCancel(context.Background())
	copied := make(chan error, 1)
	go func() {
		copied <- e.DoPair(ctx, time.Minute, ref, ref, func(context.Context, *volume.Root, *volume.Root) error {
			cancel()
			<-answer // in the kernel, deaf to ctx
			return nil
		})
	}()
	if err := <-copied; !errors.Is(err, ErrUnresponsive) {
		t.Fatalf("copy that does not stop: %v, want ErrUnresponsive", err)
	}
	if st := e.Status(); len(st) != 1 || st[0].Stuck != 1 {
		t.Errorf("exports: %+v, want one stuck call", st)
	}
	eventually(t, 10*time.Second, func() (bool, string) {
		return !isMounted(dir), "the export is still mounted after its copy was abandoned"
	})
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
