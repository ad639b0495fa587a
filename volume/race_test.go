package volume

import (
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

	"github.com/dirpv/dirpv/test/framework"
)

// swapper flips name in dir between a real directory and a symlink to outside with
// renameat2(RENAME_EXCHANGE), so the name always exists and is one or the other at any
// instant. It works through a handle on dir, never a path, so it cannot itself be sent
// outside by another swapper. If a RemoveAll took one of the two away, it puts it back.
type swapper struct {
	dirFd      int
	name, link string // link: the other name, a symlink until swapped
	target     string
	flips      atomic.Int64
}

func (s *swapper) run(stop <-chan struct{}) error {
	for {
		select {
		case <-stop:
			return nil
		default:
		}
		err := unix.Renameat2(s.dirFd, s.name, s.dirFd, s.link, unix.RENAME_EXCHANGE)
		if err == nil {
			s.flips.Add(1)
			continue
		}
		if !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("exchange %s and %s: %w", s.name, s.link, err)
		}
		// One side was removed (RemoveAll of a link removes the link): recreate the missing
		// one as a symlink; which of the two names holds the directory does not matter.
		for _, n := range []string{s.name, s.link} {
			var st unix.Stat_t
			if unix.Fstatat(s.dirFd, n, &st, unix.AT_SYMLINK_NOFOLLOW) == nil {
				continue
			}
			if err := unix.Symlinkat(s.target, s.dirFd, n); err != nil && !errors.Is(err, unix.EEXIST) {
				return fmt.Errorf("recreate %s: %w", n, err)
			}
		}
	}
}

func openDirFd(t *testing.T, path string) int {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	must(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// SECURITY.md: a symlink anywhere in the path is an error, never followed, however it is
// raced. Goroutines keep swapping each component of the volumes' paths (a, a/b, and a volume
// itself) between a real directory and a symlink to a directory outside the base that holds
// the same names, while MkdirAll and RemoveAll run on those paths. Nothing outside the base may
// be created, changed or removed, and each operation either succeeds or returns an error of
// the kinds a refused symlink or a vanished path gives.
func TestMkdirAllAndRemoveAllRacedWithSymlinkSwaps(t *testing.T) {
	top := t.TempDir()
	base := filepath.Join(top, "base")
	outside := filepath.Join(top, "outside")
	// outside mirrors the base's layout, so that a followed link would find, create or remove
	// the same names there: outside/b/vol-0 is what RemoveAll("a/b/vol-0") would delete.
	for _, d := range []string{"base/a/b/vol-leaf", "outside/b/vol-0/sub", "outside/b/vol-leaf", "outside/vol-0"} {
		must(t, os.MkdirAll(filepath.Join(top, d), 0o755))
	}
	for f, content := range map[string]string{
		"outside/b/vol-0/data": "victim", "outside/b/vol-0/sub/deeper": "deeper",
		"outside/b/vol-leaf/data": "leaf victim", "outside/vol-0/data": "shallow victim", "canary": "beside the base",
	} {
		must(t, os.WriteFile(filepath.Join(top, f), []byte(content), 0o600))
	}
	links := []struct{ dir, name, target string }{
		{base, "a", outside},
		{filepath.Join(base, "a"), "b", filepath.Join(outside, "b")},
		{filepath.Join(base, "a", "b"), "vol-leaf", filepath.Join(outside, "b", "vol-leaf")},
	}
	var swappers []*swapper
	for _, l := range links {
		must(t, os.Symlink(l.target, filepath.Join(l.dir, l.name+"-link")))
	}
	// Handles on the real directories, opened before anything swaps.
	for _, l := range links {
		swappers = append(swappers, &swapper{dirFd: openDirFd(t, l.dir), name: l.name, link: l.name + "-link", target: l.target})
	}
	before := outsideBase(t, top)

	r := rootAt(t, base)

	stop := make(chan struct{})
	var swapWG sync.WaitGroup
	swapErrs := make(chan error, len(swappers))
	for _, s := range swappers {
		swapWG.Go(func() {
			if err := s.run(stop); err != nil {
				swapErrs <- err
			}
		})
	}

	// Errors a refused or raced path may give; anything else (EBADF, EINVAL, a panic) is a bug.
	allowed := func(err error) bool {
		// The swappers put unmarked directories in place of volumes: refusing to adopt one
		// is a clean refusal.
		var exists *ExistsError
		if errors.As(err, &exists) {
			return true
		}
		for _, e := range []error{ErrNotDirectory, ErrInsideVolume, os.ErrNotExist, unix.ELOOP, unix.EXDEV,
			unix.ENOENT, unix.ENOTDIR, unix.ENOTEMPTY, unix.EEXIST, unix.EAGAIN} {
			if errors.Is(err, e) {
				return true
			}
		}
		return false
	}
	const (
		workers  = 4
		maxOps   = 3000
		maxDelay = 5 * time.Second
	)
	var (
		mu   sync.Mutex
		ok   int
		errs = map[string]int{}
	)
	deadline := time.Now().Add(maxDelay)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			owner := Owner{Mode: 0o750, UID: -1, GID: -1}
			for i := 0; i < maxOps && time.Now().Before(deadline); i++ {
				var (
					op  string
					err error
				)
				rel := fmt.Sprintf("a/b/vol-%d", i%3) // vol-0 exists outside, as b/vol-0 and vol-0
				switch i % 4 {
				case 0:
					op = "MkdirAll " + rel
					_, err = r.MkdirAll(rel, owner, Claim{UID: "uid-" + rel, PVName: "pv"})
				case 1:
					op = "RemoveAll " + rel
					err = r.RemoveAll(rel)
				case 2:
					op = "MkdirAll a/b/vol-leaf"
					_, err = r.MkdirAll("a/b/vol-leaf", owner, Claim{UID: "uid-leaf", PVName: "pv"})
				case 3:
					op = "RemoveAll a/b/vol-leaf"
					err = r.RemoveAll("a/b/vol-leaf")
				}
				mu.Lock()
				switch {
				case err == nil:
					ok++
				case allowed(err):
					errs[unwrapAll(err)]++
				default:
					t.Errorf("operation failed with an unexpected error: %s: %v", op, err)
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(stop)
	swapWG.Wait()
	close(swapErrs)
	for err := range swapErrs {
		t.Errorf("swapper: %v", err)
	}

	var flips []string
	for _, s := range swappers {
		flips = append(flips, fmt.Sprintf("%s: %d", s.name, s.flips.Load()))
	}
	t.Logf("%d operations succeeded; refused or raced: %v; swaps %s", ok, errs, strings.Join(flips, ", "))
	if ok == 0 {
		t.Errorf("no operation succeeded: the race did not leave the real directories reachable at all")
	}
	for _, s := range swappers {
		if s.flips.Load() == 0 {
			t.Errorf("%s was never swapped: nothing was raced", s.name)
		}
	}

	for _, d := range framework.DiffSnapshots(before, outsideBase(t, top)) {
		t.Errorf("outside the base: %s", d)
	}
}

// outsideBase describes every entry under top but those of top/base, so that any creation,
// removal or change outside the base shows.
func outsideBase(t *testing.T, top string) map[string]string {
	t.Helper()
	out, err := framework.SnapshotTree(top, func(rel string) bool { return rel == "base" })
	must(t, err)
	return out
}

// unwrapAll names the innermost error, for a tally of error kinds.
func unwrapAll(err error) string {
	for {
		next := errors.Unwrap(err)
		if next == nil {
			break
		}
		err = next
	}
	var errno unix.Errno
	if errors.As(err, &errno) {
		return unix.ErrnoName(errno)
	}
	return err.Error()
}
