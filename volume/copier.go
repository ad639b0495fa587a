package volume

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/internal/failpoint"
)

// devIno identifies an inode.
type devIno struct{ dev, ino uint64 }

// copier copies one tree. It holds the current directory of each side and the roots, and
// goes back up by "..", checked against the directory it came down from.
type copier struct {
	ctx   context.Context
	stats *CopyStats
	// count is the copy's own counter (WithCopyCounter), nil if it has none.
	count *CopyCounter
	// srcCur and dstCur are the directories being copied; dstRoot is the target's root, from
	// which hard links are made by path.
	srcCur, dstCur, dstRoot int
	srcMnt                  uint64
	// dstDir is the target root's inode: where the target is made inside the source (a
	// source that is not a volume), the walk must not copy the copy into itself.
	dstDir devIno
	stack  []copyLevel
	dirs   dirReader
	// links maps the inodes of files with more than one name, first copied at path (from
	// the target's root), to their path and the number of names not met yet. linkBytes is
	// what it holds, at most linkTableBytes.
	links     map[devIno]*linkGroup
	linkBytes int
	skipXattr map[string]bool
	// noReflink is set once the target refuses a clone as such (another file system, or
	// none offered), so that the other files go straight to copy_file_range.
	noReflink, noCopyRange bool
	// plainDir says that the target directory entries are made in (dstCur) hands none of
	// its NFSv4 ACL down to them, so that an entry's ACL, once it has its mode, is the one
	// its mode gives, and a source ACL that says no more (modeOnlyACL) needs no SETACL.
	plainDir          bool
	reflinked, copied int64
	entries           int64
	// files copies regular files with a single name, several at once; nil in its workers,
	// and where copyWorkers is 1.
	files *filePool
	// inDir is, in a worker of files, the path of the directory of the file it copies.
	inDir string
	buf   []byte
	xbuf  []byte
}

type copyLevel struct {
	// name is the directory's name in its parent ("" for the root).
	name string
	// children are names read and not copied yet, at most a batch and only for the deepest
	// level: a level's batch is dropped when the walk descends from it, and read again from
	// off, just past the last name taken, when the walk comes back.
	children []dirent
	off      int64
	// rescan says that off was lost when the walk came back (errOffsetLost): the directory
	// is read again from its start, and a name the target has already is one copied.
	rescan bool
	// plain is the directory's plainDir.
	plain    bool
	src, dst devIno
	times    [2]unix.Timespec
}

type linkGroup struct {
	path string
	left uint64
}

// linkTableBytes bounds the memory of a copy's hard-link table, which a tenant could grow
// with a name per file: a name of a file with several names that finds the table full is
// copied as a file of its own (CopyStats.LinksNotKept), and the file's names met later are
// linked to the first of them the table had room for. A variable for tests.
var linkTableBytes = 4 << 20

// linkEntryBytes is roughly what one entry of the table costs besides its path: the map's
// slot, the group and the string's header.
const linkEntryBytes = 96

// copyProgress counts what the process's copies made, as they go (CopyProgress).
var copyProgress CopyCounter

// CopyCounter counts what one copy made so far, read while the copy runs (for progress
// events): a copy whose context carries one (WithCopyCounter) adds to it as it goes, as it
// adds to the process's (CopyProgress).
type CopyCounter struct {
	files, bytes atomic.Int64
	started      atomic.Bool
}

// Load returns the files (of every kind) and bytes of file data copied so far, and whether
// the copy has started walking its source: it starts after the room check, so a copy
// refused for lack of space never started.
func (c *CopyCounter) Load() (files, bytes int64, started bool) {
	return c.files.Load(), c.bytes.Load(), c.started.Load()
}

type copyCounterKey struct{}

// WithCopyCounter returns ctx for a copy that counts into c as well.
func WithCopyCounter(ctx context.Context, c *CopyCounter) context.Context {
	return context.WithValue(ctx, copyCounterKey{}, c)
}

// addFiles and addBytes count into the process's counter and the copy's own, if it has one.
func (c *copier) addFiles(n int64) {
	copyProgress.files.Add(n)
	if c.count != nil {
		c.count.files.Add(n)
	}
}

func (c *copier) addBytes(n int64) {
	copyProgress.bytes.Add(n)
	if c.count != nil {
		c.count.bytes.Add(n)
	}
}

// CopyProgress returns how many files (of every kind, directories and hard links included)
// and bytes of file data (holes left out; a cloned file's size) the process's copies have
// made so far, counted as they go: those of copies that failed or were cancelled included.
func CopyProgress() (files, bytes int64) {
	return copyProgress.files.Load(), copyProgress.bytes.Load()
}

func newCopier(ctx context.Context, stats *CopyStats, srcFd, dstFd int, skipXattr string) (*copier, error) {
	count, _ := ctx.Value(copyCounterKey{}).(*CopyCounter)
	c := &copier{ctx: ctx, stats: stats, count: count, srcCur: -1, dstCur: -1, dstRoot: -1,
		links: map[devIno]*linkGroup{}, skipXattr: map[string]bool{volumeMarker: true, skipXattr: true}}
	var err error
	if c.srcMnt, err = mountID(srcFd); err != nil {
		return nil, fmt.Errorf("copy source: %w", err)
	}
	dup := func(fd int) int {
		if err != nil {
			return -1
		}
		var d int
		d, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		return d
	}
	c.dstCur, c.dstRoot = dup(dstFd), dup(dstFd)
	if err != nil {
		c.close()
		return nil, fmt.Errorf("duplicate directory handle: %w", err)
	}
	// A descriptor of its own, not a duplicate: the walk reads directories through srcCur,
	// moving its offset.
	if c.srcCur, err = openNoAtime(srcFd, "."); err != nil {
		c.close()
		return nil, fmt.Errorf("open copy source: %w", err)
	}
	var sst, dst unix.Stat_t
	if err := unix.Fstat(srcFd, &sst); err != nil {
		c.close()
		return nil, fmt.Errorf("stat copy source: %w", err)
	}
	if err := unix.Fstat(dstFd, &dst); err != nil {
		c.close()
		return nil, fmt.Errorf("stat copy target: %w", err)
	}
	c.dstDir = devIno{dst.Dev, dst.Ino}
	// The target root was made in the base, whose directory may have handed it entries of
	// its ACL; its mode is already the source root's.
	c.plainDir = modeOnlyTarget(dstFd, sst.Mode)
	handsDown, err := c.copyXattrs(fdXattrs(srcFd), fdXattrs(dstFd), "", &sst)
	if err != nil {
		c.close()
		return nil, err
	}
	c.plainDir = c.plainDir && !handsDown
	c.stats.Allocated += sst.Blocks * 512
	c.stack = []copyLevel{{src: devIno{sst.Dev, sst.Ino}, dst: c.dstDir, times: statTimes(&sst), plain: c.plainDir}}
	if copyWorkers > 1 {
		c.files = newFilePool(c, copyWorkers)
	}
	if c.count != nil {
		c.count.started.Store(true)
	}
	return c, nil
}

// waitFiles waits for the files the pool is copying, if it has one.
func (c *copier) waitFiles() error {
	if c.files == nil {
		return nil
	}
	return c.files.wait(c)
}

func (c *copier) close() {
	if c.files != nil {
		c.files.stop()
		c.files = nil
	}
	for _, fd := range []int{c.srcCur, c.dstCur, c.dstRoot} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	c.srcCur, c.dstCur, c.dstRoot = -1, -1, -1
}

func (c *copier) method() string {
	switch {
	case c.reflinked > 0 && c.copied > 0:
		return MethodMixed
	case c.reflinked > 0:
		return MethodReflink
	}
	return MethodCopy
}

// where names child of the current directory relative to the copy's root.
func (c *copier) where(child string) string {
	if c.stack == nil { // a worker of the file pool
		return c.inDir + child
	}
	var b strings.Builder
	for _, l := range c.stack[1:] {
		b.WriteString(l.name)
		b.WriteByte('/')
	}
	b.WriteString(child)
	return b.String()
}

func (c *copier) copyTree() error {
	for {
		top := &c.stack[len(c.stack)-1]
		if len(top.children) == 0 {
			more, err := c.readBatch(top)
			if err != nil {
				return err
			}
			if !more {
				// A directory's times are set once its entries are made, which changed them.
				if err := c.waitFiles(); err != nil {
					return err
				}
				if err := futimens(c.dstCur, &top.times); err != nil {
					return fmt.Errorf("copy %s: set times: %w", c.where(""), err)
				}
				if len(c.stack) == 1 {
					return nil
				}
				if err := c.up(); err != nil {
					return err
				}
				continue
			}
		}
		child := top.children[0]
		top.children = top.children[1:]
		top.off = child.off
		name := child.name
		if c.files != nil {
			if err := c.files.failed(); err != nil {
				return err
			}
		}
		if err := c.ctx.Err(); err != nil {
			return fmt.Errorf("copy %s: %w", c.where(name), err)
		}
		if top.rescan {
			var st unix.Stat_t
			if err := unix.Fstatat(c.dstCur, name, &st, unix.AT_SYMLINK_NOFOLLOW); err == nil {
				continue // copied before the walk went down and lost its place here
			}
		}
		c.entries++
		failpoint.HitAfter(failpoint.DuringCopy, c.entries)
		failpoint.PauseAt(c.ctx, failpoint.PauseDuringCopy, c.entries)
		if err := c.copyEntry(name); err != nil {
			return entryError(c.where(name), err)
		}
	}
}

// readBatch reads up to dirBatch names of the current source directory from top.off on into
// top.children, and reports false at its end. The source is read in one pass: names made
// behind the walk are not copied, as they would not be had they been made after the copy.
// Where the offset is lost (errOffsetLost: the walk came back up on a new descriptor), the
// directory is read again from its start, skipping the names the target already has.
func (c *copier) readBatch(top *copyLevel) (bool, error) {
	children, err := c.dirs.read(c.srcCur, top.off, top.children, dirBatch)
	if errors.Is(err, errOffsetLost) {
		top.off, top.rescan = 0, true
		children, err = c.dirs.read(c.srcCur, 0, top.children, dirBatch)
	}
	if errors.Is(err, unix.ENOENT) {
		c.stats.Vanished++ // the directory was removed while it was copied
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("copy %s: read directory: %w", c.where(""), err)
	}
	top.children = children
	return len(children) > 0, nil
}

// up goes back to the parent directory on both sides, checking that each is the one the
// walk came down from.
func (c *copier) up() error {
	done := c.stack[len(c.stack)-1]
	c.stack = c.stack[:len(c.stack)-1]
	parent := c.stack[len(c.stack)-1]
	sfd, err := openParent(c.srcCur, parent.src)
	if err != nil {
		return fmt.Errorf("copy %s: %w", c.where(done.name), err)
	}
	dfd, err := openParent(c.dstCur, parent.dst)
	if err != nil {
		unix.Close(sfd)
		return fmt.Errorf("copy %s (target): %w", c.where(done.name), err)
	}
	unix.Close(c.srcCur)
	unix.Close(c.dstCur)
	c.srcCur, c.dstCur, c.plainDir = sfd, dfd, parent.plain
	return nil
}

// openParent opens ".." of fd, which must be the directory want: ".." is the one lookup that
// cannot be made beneath where it starts, so its result is checked instead.
func openParent(fd int, want devIno) (int, error) {
	pfd, err := openNoAtime(fd, "..")
	if err != nil {
		return -1, fmt.Errorf("open parent: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		unix.Close(pfd)
		return -1, fmt.Errorf("stat parent: %w", err)
	}
	if (devIno{st.Dev, st.Ino}) != want {
		unix.Close(pfd)
		return -1, ErrSourceMoved
	}
	return pfd, nil
}

// openNoAtime opens the directory name ("." or "..") of fd to be read, without updating its
// access time where the kernel lets dirpv (it does for root): the walks read tenants' trees.
func openNoAtime(fd int, name string) (int, error) {
	const flags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	dfd, err := unix.Openat(fd, name, flags|unix.O_NOATIME, 0)
	if errors.Is(err, unix.EPERM) {
		dfd, err = unix.Openat(fd, name, flags, 0)
	}
	return dfd, err
}

// copyEntry copies the entry name of the current source directory into the current target
// directory, and descends into it if it is a directory.
func (c *copier) copyEntry(name string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(c.srcCur, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			c.stats.Vanished++
			return nil
		}
		return fmt.Errorf("stat: %w", err)
	}
	kind := st.Mode & unix.S_IFMT
	if kind == unix.S_IFDIR {
		return c.enterDir(name)
	}
	if kind == unix.S_IFCHR || kind == unix.S_IFBLK {
		c.stats.SkippedDevices++
		klog.FromContext(c.ctx).Info("Device node left out of a copy", "path", c.where(name))
		return nil
	}
	if kind != unix.S_IFREG && kind != unix.S_IFLNK && kind != unix.S_IFIFO && kind != unix.S_IFSOCK {
		c.stats.Vanished++ // no other kind exists; nothing to copy
		return nil
	}
	key := devIno{st.Dev, st.Ino}
	if st.Nlink > 1 {
		if g := c.links[key]; g != nil {
			if err := unix.Linkat(c.dstRoot, g.path, c.dstCur, name, 0); err != nil {
				return fmt.Errorf("link to %s: %w", g.path, err)
			}
			c.stats.HardLinks++
			c.addFiles(1)
			if g.left--; g.left == 0 {
				delete(c.links, key)
				c.linkBytes -= linkEntryBytes + len(g.path)
			}
			return nil
		}
	}
	if kind == unix.S_IFREG && st.Nlink == 1 && c.files != nil {
		return c.files.start(c, name, &st)
	}
	var made bool
	var err error
	switch kind {
	case unix.S_IFREG:
		made, err = c.copyFile(name, &st)
	case unix.S_IFLNK:
		made, err = c.copySymlink(name, &st)
	default:
		made, err = c.copySpecial(name, &st)
	}
	if err != nil || !made {
		return err
	}
	c.stats.Allocated += st.Blocks * 512
	c.addFiles(1)
	if st.Nlink > 1 {
		c.keepLink(key, name, uint64(st.Nlink)-1)
	}
	return nil
}

// keepLink records the file key just copied as name in the current directory, for its left
// other names to be made as links to it, if the table has room, and the path is one Linkat
// takes (shorter than PATH_MAX).
func (c *copier) keepLink(key devIno, name string, left uint64) {
	path := c.where(name)
	cost := linkEntryBytes + len(path)
	if c.linkBytes+cost > linkTableBytes || len(path) >= unix.PathMax {
		if c.stats.LinksNotKept == 0 {
			klog.FromContext(c.ctx).Info("Hard-link table of the copy is full: files with several names met from now on are copied once per name",
				"path", path, "limitBytes", linkTableBytes)
		}
		c.stats.LinksNotKept++
		return
	}
	c.links[key] = &linkGroup{path: path, left: left}
	c.linkBytes += cost
}

// openBeneath opens name in dirFd without following symlinks or leaving dirFd. A file it
// creates has mode 0600.
func openBeneath(dirFd int, name string, flags int) (int, error) {
	how := &unix.OpenHow{Flags: uint64(flags | unix.O_NOFOLLOW | unix.O_CLOEXEC), Resolve: resolveBeneath}
	if flags&unix.O_CREAT != 0 {
		how.Mode = 0o600
	}
	return unix.Openat2(dirFd, name, how)
}

// openSource opens name in the current source directory, without updating its access time
// where allowed. It reports false if name is gone or is no longer of kind.
func (c *copier) openSource(name string, flags int, kind uint32, st *unix.Stat_t) (int, bool, error) {
	fd, err := openBeneath(c.srcCur, name, flags|unix.O_NOATIME)
	if errors.Is(err, unix.EPERM) {
		fd, err = openBeneath(c.srcCur, name, flags)
	}
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENOTDIR):
		// Gone, or replaced by a symlink or (for a directory) something else meanwhile.
		c.stats.Vanished++
		return -1, false, nil
	case err != nil:
		return -1, false, fmt.Errorf("open: %w", err)
	}
	if err := unix.Fstat(fd, st); err != nil {
		unix.Close(fd)
		return -1, false, fmt.Errorf("stat: %w", err)
	}
	if st.Mode&unix.S_IFMT != kind {
		unix.Close(fd)
		c.stats.Vanished++
		return -1, false, nil
	}
	return fd, true, nil
}

func (c *copier) enterDir(name string) error {
	var st unix.Stat_t
	sfd, ok, err := c.openSource(name, unix.O_RDONLY|unix.O_DIRECTORY, unix.S_IFDIR, &st)
	if err != nil || !ok {
		return err
	}
	keep := false
	defer func() {
		if !keep {
			unix.Close(sfd)
		}
	}()
	if (devIno{st.Dev, st.Ino}) == c.dstDir {
		return nil // the copy itself, made inside its source
	}
	if err := c.checkMount(sfd, name); err != nil {
		return err
	}
	if err := unix.Mkdirat(c.dstCur, name, 0o700); err != nil {
		return fmt.Errorf("mkdir: %w", err)
	}
	dfd, err := openBeneath(c.dstCur, name, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return fmt.Errorf("open new directory: %w", err)
	}
	fail := func(err error) error {
		unix.Close(dfd)
		return err
	}
	if err := setOwnerMode(dfd, &st); err != nil {
		return fail(err)
	}
	handsDown, err := c.copyXattrs(fdXattrs(sfd), fdXattrs(dfd), name, &st)
	if err != nil {
		return fail(err)
	}
	var dst unix.Stat_t
	if err := unix.Fstat(dfd, &dst); err != nil {
		return fail(fmt.Errorf("stat new directory: %w", err))
	}
	c.stats.Dirs++
	c.stats.Allocated += st.Blocks * 512
	c.addFiles(1)
	unix.Close(c.srcCur)
	unix.Close(c.dstCur)
	c.srcCur, c.dstCur, keep = sfd, dfd, true
	// A new directory in a plain one was handed nothing; it hands down what it was given.
	c.plainDir = c.plainDir && !handsDown
	// Into the directory at once; what is left of the parent's batch is read again on the
	// way back, so that only one batch of names is held whatever the depth.
	c.stack[len(c.stack)-1].children = nil
	c.stack = append(c.stack, copyLevel{name: name, plain: c.plainDir,
		src: devIno{st.Dev, st.Ino}, dst: devIno{dst.Dev, dst.Ino}, times: statTimes(&st)})
	return nil
}

// checkMount fails with ErrMountInSource if the source entry name, open at fd, is on another
// mount than the source's root: a directory or a file mounted there (a bind mount of a single
// file is one too).
func (c *copier) checkMount(fd int, name string) error {
	mnt, err := mountID(fd)
	if err != nil {
		return err
	}
	if mnt != c.srcMnt {
		return fmt.Errorf("%s %w", c.where(name), ErrMountInSource)
	}
	return nil
}
