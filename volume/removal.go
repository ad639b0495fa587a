package volume

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// RemoveAll removes rel and everything below it. It never follows a symlink (a symlink is
// removed, its target untouched) and never crosses a mount point, bind mounts of the same file
// system included: one inside the tree stops the removal with an error, so a still-mounted
// volume or a mount planted inside it cannot lead to deleting someone else's data. A missing
// rel is not an error.
func (r *Root) RemoveAll(rel string) error {
	rm, err := r.StartRemoval(rel)
	if err != nil {
		return err
	}
	defer rm.Close()
	for {
		_, done, err := rm.Step(math.MaxInt)
		if err != nil || done {
			return err
		}
	}
}

// Removal is a RemoveAll done in steps, for trees too big to remove within one deadline: each
// Step does a bounded amount of work and the next one carries on where it stopped. It makes
// RemoveAll's promises (no symlink followed, no mount crossed, one directory open at a time
// whatever the depth) and holds its two descriptors between steps. Its memory is bounded too:
// a directory is read dirBatch names at a time, never listed whole, since a tenant decides
// how many names its volume's directories hold. It is not safe for concurrent use.
type Removal struct {
	// what names the tree in errors: rel in the root's path.
	what     string
	parentFd int
	name     string
	mnt      uint64
	started  bool
	done     bool
	// cur is the directory being emptied, the last of stack; -1 before the walk descends.
	cur   int
	stack []removalLevel
	// batch is how many names are read from a directory at a time (dirBatch).
	batch int
	dirs  dirReader
}

type removalLevel struct {
	name     string
	dev, ino uint64
	// children are the names read and not yet removed, at most a batch and only for the
	// deepest level: a level's batch is dropped when the walk descends from it, and read
	// again from off when the walk comes back.
	children []dirent
	// off is where the next read of the directory starts: just past the last name taken
	// from it. seen records whether this pass over the directory, since off was last 0,
	// found any name; a pass from the start that finds none means the directory is empty.
	off  int64
	seen bool
}

// StartRemoval prepares the removal of rel; nothing is removed until Step. A missing parent of
// rel gives a Removal that is done at once. Close it when done.
func (r *Root) StartRemoval(rel string) (*Removal, error) {
	if _, err := CleanRelPath(rel); err != nil {
		return nil, err
	}
	parent, name := split(rel)
	rm := &Removal{what: rel + " in " + r.path, parentFd: -1, name: name, cur: -1, batch: dirBatch}
	parentFd, err := r.openDir(parent, unix.O_RDONLY)
	if errors.Is(err, os.ErrNotExist) {
		rm.started, rm.done = true, true
		return rm, nil
	}
	if err != nil {
		return nil, err
	}
	mnt, err := mountID(parentFd)
	if err != nil {
		unix.Close(parentFd)
		return nil, fmt.Errorf("%s in %s: %w", parent, r.path, err)
	}
	rm.parentFd, rm.mnt = parentFd, mnt
	return rm, nil
}

// Close releases the removal's descriptors; the tree is left as far as it got.
func (rm *Removal) Close() error {
	if rm.cur >= 0 {
		unix.Close(rm.cur)
		rm.cur = -1
	}
	if rm.parentFd >= 0 {
		unix.Close(rm.parentFd)
		rm.parentFd = -1
	}
	rm.done = true
	return nil
}

// Step removes up to max entries (files, links and emptied directories) and reports how many
// it removed and whether the whole tree is gone. After an error the Removal is spent: Close
// it and start again, which carries on from what is left.
func (rm *Removal) Step(max int) (removed int, done bool, err error) {
	if rm.done {
		return 0, true, nil
	}
	removed, err = rm.step(max)
	if err != nil {
		rm.Close()
		return removed, false, fmt.Errorf("remove %s: %w", rm.what, err)
	}
	return removed, rm.done, nil
}

// where names child of the current directory relative to the removed tree's parent.
func (rm *Removal) where(child string) string {
	var b strings.Builder
	for _, l := range rm.stack {
		b.WriteString(l.name)
		b.WriteByte('/')
	}
	b.WriteString(child)
	return b.String()
}

// descend opens the directory child of fd, checks it is on the same mount and makes it the
// current level, its names not read yet. It reports false if child is gone.
func (rm *Removal) descend(fd int, child string) (int, bool, error) {
	cfd, err := unix.Openat(fd, child, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return -1, false, nil
	}
	if err != nil {
		return -1, false, fmt.Errorf("open %s: %w", rm.where(child), err)
	}
	fail := func(err error) (int, bool, error) {
		unix.Close(cfd)
		return -1, false, err
	}
	if id, err := mountID(cfd); err != nil {
		return fail(fmt.Errorf("%s: %w", rm.where(child), err))
	} else if id != rm.mnt {
		return fail(fmt.Errorf("%s is a mount point, refusing to remove across it", rm.where(child)))
	}
	var st unix.Stat_t
	if err := unix.Fstat(cfd, &st); err != nil {
		return fail(fmt.Errorf("stat %s: %w", rm.where(child), err))
	}
	rm.stack = append(rm.stack, removalLevel{name: child, dev: st.Dev, ino: st.Ino})
	return cfd, true, nil
}

// readBatch reads up to rm.batch names of the current directory into top.children, from
// top.off on. It reports false when the directory is empty: a pass from its start found no
// name. Reaching the end after a pass that found names starts another pass from the start,
// since a directory offset need not stay valid while names are removed (it does not on
// every file system), and names made meanwhile must go too.
func (rm *Removal) readBatch(top *removalLevel) (bool, error) {
	// A descriptor of its own, so that the offset set here moves no one else's, closed at
	// once, so that the walk still holds only cur and parentFd between reads.
	fd, err := unix.Openat(rm.cur, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("open %s: %w", rm.where(""), err)
	}
	defer unix.Close(fd)
	for {
		children, err := rm.dirs.read(fd, top.off, top.children, rm.batch)
		if errors.Is(err, errOffsetLost) {
			// A pass from the start finds whatever is left.
			top.off, top.seen = 0, false
			continue
		}
		if err != nil {
			return false, fmt.Errorf("read directory %s: %w", rm.where(""), err)
		}
		if len(children) == 0 {
			// seen is false only while a pass that began at the start has found nothing.
			if !top.seen {
				return false, nil
			}
			top.off, top.seen = 0, false
			continue
		}
		top.children, top.seen = children, true
		return true, nil
	}
}

// step walks the tree holding one directory open at a time, whatever its depth: a tenant
// decides how deep its volume is, and one descriptor per level would let it exhaust the
// process's descriptors (failing this removal forever and starving everything else the
// process does meanwhile). Going back up uses "..", checked against the device and inode
// recorded on the way down, so a directory moved during the walk stops it instead of leading
// it elsewhere.
func (rm *Removal) step(max int) (int, error) {
	removed := 0
	if !rm.started {
		rm.started = true
		err := unix.Unlinkat(rm.parentFd, rm.name, 0)
		switch {
		case err == nil:
			rm.done = true
			return 1, nil
		case errors.Is(err, unix.ENOENT):
			rm.done = true
			return 0, nil
		case !errors.Is(err, unix.EISDIR):
			return 0, fmt.Errorf("unlink %s: %w", rm.name, err)
		}
		cfd, ok, err := rm.descend(rm.parentFd, rm.name)
		if err != nil {
			return 0, err
		}
		if !ok {
			rm.done = true
			return 0, nil
		}
		rm.cur = cfd
	}
	for len(rm.stack) > 0 && removed < max {
		top := &rm.stack[len(rm.stack)-1]
		if len(top.children) == 0 {
			more, err := rm.readBatch(top)
			if err != nil {
				return removed, err
			}
			if !more {
				top.children = nil
			}
		}
		if len(top.children) > 0 {
			child := top.children[0]
			top.children = top.children[1:]
			top.off = child.off
			err := unix.Unlinkat(rm.cur, child.name, 0)
			switch {
			case err == nil:
				removed++
				continue
			case errors.Is(err, unix.ENOENT):
				continue
			case !errors.Is(err, unix.EISDIR):
				return removed, fmt.Errorf("unlink %s: %w", rm.where(child.name), err)
			}
			// Into the directory at once, so that every name read is gone before the next
			// pass over this one. What is left of this batch is read again on the way back.
			top.children = nil
			cfd, ok, err := rm.descend(rm.cur, child.name)
			if err != nil {
				return removed, err
			}
			if ok {
				unix.Close(rm.cur)
				rm.cur = cfd
			}
			continue
		}
		// The current directory is empty: go back to its parent and remove it there.
		done := rm.stack[len(rm.stack)-1]
		rm.stack = rm.stack[:len(rm.stack)-1]
		if len(rm.stack) == 0 {
			if err := unix.Unlinkat(rm.parentFd, done.name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
				return removed, fmt.Errorf("rmdir %s: %w", done.name, err)
			}
			// The record file goes last, so that a volume whose removal fails stays marked. A
			// crash in between leaves a record naming an inode that is gone; a directory made
			// later with that inode drops or overwrites it.
			if err := dropRecordOf(rm.parentFd, done.ino); err != nil {
				return removed + 1, err
			}
			rm.Close()
			return removed + 1, nil
		}
		pfd, err := unix.Openat(rm.cur, "..", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return removed, fmt.Errorf("open %s: %w", rm.where(""), err)
		}
		unix.Close(rm.cur)
		rm.cur = pfd
		var st unix.Stat_t
		if err := unix.Fstat(rm.cur, &st); err != nil {
			return removed, fmt.Errorf("stat %s: %w", rm.where(""), err)
		}
		if parent := rm.stack[len(rm.stack)-1]; st.Dev != parent.dev || st.Ino != parent.ino {
			return removed, fmt.Errorf("%s was moved while it was being removed, stopping", rm.where(done.name))
		}
		if err := unix.Unlinkat(rm.cur, done.name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
			return removed, fmt.Errorf("rmdir %s: %w", rm.where(done.name), err)
		}
		removed++
	}
	return removed, nil
}

// removeVolumeAt removes name in parentFd and everything below it, as RemoveAll does, record
// file included. parentFd stays open.
func removeVolumeAt(parentFd int, name string, mnt uint64) error {
	fd, err := unix.FcntlInt(uintptr(parentFd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("duplicate directory handle: %w", err)
	}
	rm := &Removal{what: name, parentFd: fd, name: name, mnt: mnt, cur: -1, batch: dirBatch}
	defer rm.Close()
	for {
		_, done, err := rm.Step(math.MaxInt)
		if err != nil || done {
			return err
		}
	}
}
