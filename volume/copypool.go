package volume

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// copyWorkers is how many regular files a copy makes at once. Making a file is a chain of
// calls that each wait for the target (create, copy, owner, mode, attributes, times, close:
// each a round trip to the server on NFS), so one file at a time leaves the server and the
// link idle most of the time; a few files at once overlap those waits. Each worker holds
// at most a copy buffer (copyRange's, only where copy_file_range cannot be used) and two
// directory descriptors. A variable for tests.
var copyWorkers = 4

// filePool copies regular files with a single name for the walk, copyWorkers at a time.
// Everything else (directories, files with several names, symlinks, special files) the walk
// makes itself, in order: a file with several names is linked from the table only the walk
// keeps. A directory's times are set once the pool has finished (wait) the files made in it.
type filePool struct {
	jobs    chan fileJob
	pending sync.WaitGroup // jobs sent and not finished
	running sync.WaitGroup // the workers' goroutines
	workers []*copier
	mu      sync.Mutex
	err     error // the first job's error; no job runs after it
}

// fileJob is one regular file to copy: name in the directories open at src and dst, which the
// job owns (duplicates: the walk may move on meanwhile), inDir their path from the copy's root.
type fileJob struct {
	src, dst int
	inDir    string
	name     string
	st       unix.Stat_t
	// plain is the walk's plainDir for the directory.
	plain bool
}

func newFilePool(c *copier, n int) *filePool {
	p := &filePool{jobs: make(chan fileJob)}
	for range n {
		w := &copier{ctx: c.ctx, stats: &CopyStats{}, count: c.count, srcCur: -1, dstCur: -1, dstRoot: -1,
			srcMnt: c.srcMnt, skipXattr: c.skipXattr}
		p.workers = append(p.workers, w)
		p.running.Add(1)
		go func() {
			defer p.running.Done()
			for j := range p.jobs {
				if p.failed() == nil {
					if err := w.copyJob(j); err != nil {
						p.fail(err)
					}
				}
				unix.Close(j.src)
				unix.Close(j.dst)
				p.pending.Done()
			}
		}()
	}
	return p
}

// start hands the regular file name of the walk's current directories, stat st, to the
// first free worker, waiting for one.
func (p *filePool) start(c *copier, name string, st *unix.Stat_t) error {
	src, err := unix.FcntlInt(uintptr(c.srcCur), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("duplicate directory handle: %w", err)
	}
	dst, err := unix.FcntlInt(uintptr(c.dstCur), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		unix.Close(src)
		return fmt.Errorf("duplicate directory handle: %w", err)
	}
	p.pending.Add(1)
	p.jobs <- fileJob{src: src, dst: dst, inDir: c.where(""), name: name, st: *st, plain: c.plainDir}
	return nil
}

// copyJob is copyEntry's end for a regular file with a single name, on a worker.
func (c *copier) copyJob(j fileJob) error {
	c.srcCur, c.dstCur, c.inDir, c.plainDir = j.src, j.dst, j.inDir, j.plain
	defer func() { c.srcCur, c.dstCur = -1, -1 }()
	made, err := c.copyFile(j.name, &j.st)
	if err != nil {
		return entryError(c.where(j.name), err)
	}
	if made {
		c.stats.Allocated += j.st.Blocks * 512
		c.addFiles(1)
	}
	return nil
}

func (p *filePool) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err == nil {
		p.err = err
	}
}

// failed returns the error of a job that failed, if one has.
func (p *filePool) failed() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// wait waits until the jobs started are finished, adds what they made to c's counts and
// returns the first error of one.
func (p *filePool) wait(c *copier) error {
	p.pending.Wait()
	for _, w := range p.workers {
		c.stats.add(w.stats)
		*w.stats = CopyStats{}
		c.reflinked += w.reflinked
		c.copied += w.copied
		w.reflinked, w.copied = 0, 0
	}
	return p.failed()
}

// stop ends the workers, once the jobs started are finished.
func (p *filePool) stop() {
	close(p.jobs)
	p.running.Wait()
}

// add adds o's counts to s's.
func (s *CopyStats) add(o *CopyStats) {
	s.Dirs += o.Dirs
	s.Files += o.Files
	s.Symlinks += o.Symlinks
	s.HardLinks += o.HardLinks
	s.Special += o.Special
	s.Bytes += o.Bytes
	s.Allocated += o.Allocated
	s.SkippedDevices += o.SkippedDevices
	s.Vanished += o.Vanished
	s.XattrsSkipped += o.XattrsSkipped
	s.LinksNotKept += o.LinksNotKept
}

// entryError is the error of copying the entry at where (from the copy's root).
func entryError(where string, err error) error {
	if errors.Is(err, unix.EDQUOT) || errors.Is(err, unix.ENOSPC) {
		return fmt.Errorf("copy %s: the new volume is full: %w", where, err)
	}
	return fmt.Errorf("copy %s: %w", where, err)
}
