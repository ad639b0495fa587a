package volume

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume/quota"
)

// Source names a tree to copy a new volume from: a volume directory beneath Root, or a
// snapshot (Root.SnapshotSource).
type Source struct {
	Root *Root
	Rel  string
}

// How a copy was made (CopyStats.Method).
const (
	// MethodBtrfsSnapshot: the new volume is a btrfs snapshot of the source subvolume; nothing
	// was walked.
	MethodBtrfsSnapshot = "btrfs-snapshot"
	// MethodReflink: every regular file was cloned (FICLONE), sharing its extents.
	MethodReflink = "reflink"
	// MethodCopy: every regular file's data was copied (copy_file_range, or read and write).
	MethodCopy = "copy"
	// MethodMixed: some files were cloned and some copied.
	MethodMixed = "mixed"
)

// CopyStats says what a copy made. With MethodBtrfsSnapshot nothing is walked and the counts
// are 0.
type CopyStats struct {
	// Dirs, Files, Symlinks count what was made below the volume's root; HardLinks the extra
	// names of files already copied, made as links to the copy; Special the FIFOs and sockets
	// made again (mknod; a socket is only a name, nothing listens on it in the copy).
	Dirs, Files, Symlinks, HardLinks, Special int64
	// Bytes is the apparent size of the regular files copied, each inode once.
	Bytes int64
	// Allocated is the space the source's files and directories occupied (st_blocks), each
	// inode once: what a limit on the copy must hold.
	Allocated int64
	// SkippedDevices counts character and block device nodes left out, Vanished the entries
	// that went, or changed kind, while the copy ran, XattrsSkipped the extended attributes the
	// target's file system does not support.
	SkippedDevices, Vanished, XattrsSkipped int64
	// Method is how the files' data was copied: one of the Method constants.
	Method string
}

// ErrMountInSource is returned when the source of a copy has a mount point inside it: a
// copy never crosses one, as RemoveAll never does, and a copy without what is mounted there
// would be silently incomplete.
var ErrMountInSource = errors.New("is a mount point inside the source; a copy never crosses a mount")

// ErrSourceMoved is returned when a directory of the source was moved elsewhere while it was
// being copied; the copy stops rather than follow it. Trying again copies what is there then.
var ErrSourceMoved = errors.New("was moved while it was being copied")

// MkdirAllFrom is MkdirAllLimited (limit 0: MkdirAll, no limit) for a volume that starts as a
// copy of src's tree. The copy is made inside the volume's temporary directory, after its
// limit is set and before it is renamed into place, so a claim never gets a half copy; what a
// crash leaves there is removed by the next attempt, which copies again. The volume's root
// takes the source root's mode, owner, extended attributes and times, as cp -a would. A
// volume that exists for claim is adopted as MkdirAll does, with nothing copied.
//
// What the copy keeps: directories, regular files (holes kept: only data extents are copied),
// symlinks (copied, never followed), hard links (as links within the copy), FIFOs and
// sockets (made again), modes (setuid, setgid and sticky included), owners, access and
// modification times, and extended attributes of every namespace (trusted.* and security.*
// too: dirpv runs as root; ACLs are their system.posix_acl_* attributes) except dirpv's own
// volume marker. An attribute the target's file system does not support (ENOTSUP) is left
// out and counted, as a copy to NFS must. Device nodes are left out and counted: one written
// by a pod into its volume would otherwise become, in a clone, a device node that no one
// reviewed, readable by whoever can read the clone on the host.
//
// The walk never follows a symlink, never leaves either tree (every lookup is openat2 beneath
// the directory it starts from, without symlinks; going back up checks the directory is the
// one it left) and never crosses a mount (ErrMountInSource). It holds a constant number of
// descriptors whatever the tree's size or depth, and lists one directory at a time. The source
// may be written meanwhile: an entry that goes or changes kind before it is copied is left
// out (Vanished); a file written meanwhile is copied as it is read; a directory moved away
// while its children are copied stops the copy (ErrSourceMoved). ctx is checked between
// entries and between chunks of a file.
//
// Where the base is btrfs, the target limited and the source a subvolume of the same file
// system (a limited volume, or a snapshot of one) holding no nested subvolume (which a
// snapshot would leave empty, so such a source is walked), the new volume is a snapshot of it
// (MethodBtrfsSnapshot) given its own qgroup limit, which fails if the source already uses
// more. A snapshot keeps the subvolume as it is, device nodes included: leaving them out would
// mean walking the tree the snapshot spares; the clone is in the source's namespace, and the
// node was already as exposed in the source. Elsewhere each file is cloned (FICLONE) where
// the file system can, copied otherwise. A copy that does not fit the limit fails with an
// error wrapping unix.EDQUOT or ENOSPC.
//
// It works on handles of its own: r and src.Root may be closed once it has started.
func (r *Root) MkdirAllFrom(ctx context.Context, rel string, claim Claim, limit uint64, src Source) (created bool, id quota.ID, stats CopyStats, err error) {
	if src.Root == nil {
		return false, quota.ID{}, stats, fmt.Errorf("volume %s: no source to copy from", rel)
	}
	if r, src.Root, err = dupRoots(r, src.Root); err != nil {
		return false, quota.ID{}, stats, err
	}
	defer r.Close()
	defer src.Root.Close()
	if limit > 0 {
		fs, err := r.Quota()
		if err != nil {
			return false, quota.ID{}, stats, err
		}
		if err := fs.Enforces(); err != nil {
			return false, quota.ID{}, stats, fmt.Errorf("base %s: %w", r.path, err)
		}
	}
	from := &copyFrom{ctx: ctx, src: src, fd: -1, stats: &stats}
	defer from.close()
	// The owner is the source root's, read once the source is opened (makeMarked).
	created, id, err = r.mkdirAll(rel, Owner{}, claim, limit, from)
	if err == nil && created {
		klog.FromContext(ctx).V(2).Info("Volume copied", "path", rel, "base", r.path,
			"source", src.Rel, "sourceBase", src.Root.path, "stats", stats)
	}
	return created, id, stats, err
}

// dupRoots returns handles of their own on target and source, for a copy: one can outlast
// the wait for it at shutdown (nothing interrupts a clone of a huge file), after which its
// caller closes its roots, and a descriptor number closed under the copy can be handed to
// another file before the copy uses it.
func dupRoots(target, source *Root) (*Root, *Root, error) {
	t, err := target.Dup()
	if err != nil {
		return nil, nil, err
	}
	s, err := source.Dup()
	if err != nil {
		t.Close()
		return nil, nil, err
	}
	return t, s, nil
}

// copyFrom is what createVolume needs to fill a new volume from a source.
type copyFrom struct {
	ctx context.Context
	src Source
	// fd is the source's root directory, -1 until open; owner is its mode and owner.
	fd    int
	owner Owner
	stats *CopyStats
}

// open opens the source, once a volume is to be made: an adopted one needs no source, which
// may be gone by the time a retry adopts it.
func (f *copyFrom) open() error {
	fd, err := openSourceDir(f.src.Root, f.src.Rel)
	if err != nil {
		return fmt.Errorf("copy source: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return fmt.Errorf("stat copy source %s in %s: %w", f.src.Rel, f.src.Root.path, err)
	}
	f.fd, f.owner = fd, Owner{Mode: st.Mode & 0o7777, UID: int(st.Uid), GID: int(st.Gid)}
	return nil
}

func (f *copyFrom) close() {
	if f.fd >= 0 {
		unix.Close(f.fd)
		f.fd = -1
	}
}

// snapshot makes name in parentFd a btrfs snapshot of the source, if there is one and it is a
// subvolume of fs, btrfs with quota on; it reports false, having made nothing, if not.
func (f *copyFrom) snapshot(fs *quota.FS, parentFd int, name string) (bool, error) {
	if f == nil || fs.Kind() != quota.Btrfs {
		return false, nil
	}
	err := quota.Snapshot(f.fd, parentFd, name, false)
	if errors.Is(err, quota.ErrNoSnapshot) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("snapshot %s in %s: %w", f.src.Rel, f.src.Root.path, err)
	}
	f.stats.Method = MethodBtrfsSnapshot
	return true, nil
}

// checkFits fails, wrapping EDQUOT, if the volume open at fd, limited by id, already holds
// more than its limit: a snapshot of a source bigger than the new volume may hold.
func checkFits(fs *quota.FS, fd int, id quota.ID) error {
	u, err := fs.Usage(fd, id)
	if err != nil {
		return fmt.Errorf("read the snapshot's usage: %w", err)
	}
	if u.LimitBytes > 0 && u.UsedBytes > u.LimitBytes {
		return fmt.Errorf("the source holds %d bytes, more than the new volume's limit of %d: %w", u.UsedBytes, u.LimitBytes, unix.EDQUOT)
	}
	return nil
}

// openSourceDir opens the directory rel of root as a copy source: read-only, and without
// updating its access time where the kernel lets dirpv (it does for root).
func openSourceDir(root *Root, rel string) (int, error) {
	fd, err := root.openDir(rel, unix.O_RDONLY|unix.O_NOATIME)
	if errors.Is(err, unix.EPERM) {
		fd, err = root.openDir(rel, unix.O_RDONLY)
	}
	return fd, err
}

// fill copies the source's tree into the new volume's directory open at fd, whose mode and
// owner are already the source root's.
func (f *copyFrom) fill(fd int, skipXattr string) error {
	c, err := newCopier(f.ctx, f.stats, f.fd, fd, skipXattr)
	if err != nil {
		return err
	}
	defer c.close()
	if err := c.copyTree(); err != nil {
		return err
	}
	f.stats.Method = c.method()
	return nil
}

// devIno identifies an inode.
type devIno struct{ dev, ino uint64 }

// copier copies one tree. It holds the current directory of each side and the roots, and
// goes back up by "..", checked against the directory it came down from.
type copier struct {
	ctx   context.Context
	stats *CopyStats
	// srcCur and dstCur are the directories being copied; dstRoot is the target's root, from
	// which hard links are made by path.
	srcCur, dstCur, dstRoot int
	srcMnt                  uint64
	// dstDir is the target root's inode: where the target is made inside the source (a
	// source that is not a volume), the walk must not copy the copy into itself.
	dstDir devIno
	stack  []copyLevel
	// links maps the inodes of files with more than one name, first copied at path (from
	// the target's root), to their path and the number of names not met yet.
	links     map[devIno]*linkGroup
	skipXattr map[string]bool
	// noReflink is set once the target refuses a clone as such (another file system, or
	// none offered), so that the other files go straight to copy_file_range.
	noReflink, noCopyRange bool
	reflinked, copied      int64
	entries                int64
	buf                    []byte
	xbuf                   []byte
}

type copyLevel struct {
	// name is the directory's name in its parent ("" for the root); names are its entries
	// not copied yet.
	name     string
	names    []string
	src, dst devIno
	times    [2]unix.Timespec
}

type linkGroup struct {
	path string
	left uint64
}

func newCopier(ctx context.Context, stats *CopyStats, srcFd, dstFd int, skipXattr string) (*copier, error) {
	c := &copier{ctx: ctx, stats: stats, srcCur: -1, dstCur: -1, dstRoot: -1,
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
	c.srcCur, c.dstCur, c.dstRoot = dup(srcFd), dup(dstFd), dup(dstFd)
	if err != nil {
		c.close()
		return nil, fmt.Errorf("duplicate directory handle: %w", err)
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
	if err := c.copyXattrs(fdXattrs(srcFd), fdXattrs(dstFd), ""); err != nil {
		c.close()
		return nil, err
	}
	c.stats.Allocated += sst.Blocks * 512
	names, err := listNames(c.srcCur)
	if err != nil {
		c.close()
		return nil, fmt.Errorf("list copy source: %w", err)
	}
	c.stack = []copyLevel{{names: names, src: devIno{sst.Dev, sst.Ino}, dst: c.dstDir, times: statTimes(&sst)}}
	return c, nil
}

func (c *copier) close() {
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
		if len(top.names) == 0 {
			// A directory's times are set once its entries are made, which changed them.
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
		name := top.names[0]
		top.names = top.names[1:]
		if err := c.ctx.Err(); err != nil {
			return fmt.Errorf("copy %s: %w", c.where(name), err)
		}
		c.entries++
		failpoint.HitAfter(failpoint.DuringCopy, c.entries)
		failpoint.PauseAt(c.ctx, failpoint.PauseDuringCopy, c.entries)
		if err := c.copyEntry(name); err != nil {
			if errors.Is(err, unix.EDQUOT) || errors.Is(err, unix.ENOSPC) {
				return fmt.Errorf("copy %s: the new volume is full: %w", c.where(name), err)
			}
			return fmt.Errorf("copy %s: %w", c.where(name), err)
		}
	}
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
	c.srcCur, c.dstCur = sfd, dfd
	return nil
}

// openParent opens ".." of fd, which must be the directory want: ".." is the one lookup that
// cannot be made beneath where it starts, so its result is checked instead.
func openParent(fd int, want devIno) (int, error) {
	pfd, err := unix.Openat(fd, "..", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
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
			if g.left--; g.left == 0 {
				delete(c.links, key)
			}
			return nil
		}
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
	if st.Nlink > 1 {
		c.links[key] = &linkGroup{path: c.where(name), left: uint64(st.Nlink) - 1}
	}
	return nil
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
	names, err := listNames(sfd)
	if errors.Is(err, unix.ENOENT) {
		c.stats.Vanished++ // removed since it was opened
		return nil
	}
	if err != nil {
		return fmt.Errorf("list: %w", err)
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
	if err := c.copyXattrs(fdXattrs(sfd), fdXattrs(dfd), name); err != nil {
		return fail(err)
	}
	var dst unix.Stat_t
	if err := unix.Fstat(dfd, &dst); err != nil {
		return fail(fmt.Errorf("stat new directory: %w", err))
	}
	c.stats.Dirs++
	c.stats.Allocated += st.Blocks * 512
	unix.Close(c.srcCur)
	unix.Close(c.dstCur)
	c.srcCur, c.dstCur, keep = sfd, dfd, true
	c.stack = append(c.stack, copyLevel{name: name, names: names,
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

func (c *copier) copyFile(name string, lst *unix.Stat_t) (bool, error) {
	var st unix.Stat_t
	// O_NONBLOCK: should a FIFO take the file's place, the open must not wait for a writer.
	sfd, ok, err := c.openSource(name, unix.O_RDONLY|unix.O_NONBLOCK, unix.S_IFREG, &st)
	if err != nil || !ok {
		return false, err
	}
	defer unix.Close(sfd)
	if err := c.checkMount(sfd, name); err != nil {
		return false, err
	}
	*lst = st
	dfd, err := openBeneath(c.dstCur, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL)
	if err != nil {
		return false, fmt.Errorf("create: %w", err)
	}
	defer unix.Close(dfd)
	if err := c.copyData(dfd, sfd, st.Size); err != nil {
		return false, err
	}
	// chown before chmod: chown clears setuid and setgid, and file capabilities
	// (security.capability), which the attributes copied after it bring back.
	if err := setOwnerMode(dfd, &st); err != nil {
		return false, err
	}
	if err := c.copyXattrs(fdXattrs(sfd), fdXattrs(dfd), name); err != nil {
		return false, err
	}
	times := statTimes(&st)
	if err := futimens(dfd, &times); err != nil {
		return false, fmt.Errorf("set times: %w", err)
	}
	c.stats.Files++
	c.stats.Bytes += st.Size
	return true, nil
}

// copyData makes the file open at dst hold the data of src, size bytes: a clone of it where
// the file system can, else a copy of its data extents only, so holes stay holes.
func (c *copier) copyData(dst, src int, size int64) error {
	if size == 0 {
		return nil // no data: neither cloned nor copied
	}
	if !c.noReflink {
		err := unix.IoctlFileClone(dst, src)
		switch {
		case err == nil:
			c.reflinked++
			return nil
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOTTY),
			errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EBADF):
			c.noReflink = true
		case errors.Is(err, unix.EINVAL), errors.Is(err, unix.EPERM), errors.Is(err, unix.ETXTBSY):
			// This file only (a swap file, one being executed, incompatible flags).
		default:
			return fmt.Errorf("clone data (FICLONE): %w", err)
		}
	}
	c.copied++
	for off := int64(0); off < size; {
		data, err := unix.Seek(src, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left (or the file shrank)
		}
		if err != nil {
			return fmt.Errorf("find data (SEEK_DATA): %w", err)
		}
		hole, err := unix.Seek(src, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("find hole (SEEK_HOLE): %w", err)
		}
		end := min(hole, size)
		if err := c.copyRange(dst, src, data, end); err != nil {
			return err
		}
		off = end
	}
	if err := unix.Ftruncate(dst, size); err != nil {
		return fmt.Errorf("set size: %w", err)
	}
	return nil
}

// copyChunk bounds one copy call, so that ctx is checked while a large file is copied.
const copyChunk = 64 << 20

// copyRange copies bytes [off, end) of src to the same place in dst.
func (c *copier) copyRange(dst, src int, off, end int64) error {
	for off < end {
		if err := c.ctx.Err(); err != nil {
			return err
		}
		n := int(min(end-off, copyChunk))
		if !c.noCopyRange {
			roff, woff := off, off
			got, err := unix.CopyFileRange(src, &roff, dst, &woff, n, 0)
			switch {
			case err == nil && got == 0:
				return nil // the file shrank while it was copied
			case err == nil:
				off += int64(got)
				continue
			case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS),
				errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EBADF):
				c.noCopyRange = true
			default:
				return fmt.Errorf("copy data (copy_file_range): %w", err)
			}
		}
		if c.buf == nil {
			c.buf = make([]byte, 1<<20)
		}
		buf := c.buf[:min(n, len(c.buf))]
		got, err := unix.Pread(src, buf, off)
		if err != nil {
			return fmt.Errorf("read data: %w", err)
		}
		if got == 0 {
			return nil
		}
		if _, err := unix.Pwrite(dst, buf[:got], off); err != nil {
			return fmt.Errorf("write data: %w", err)
		}
		off += int64(got)
	}
	return nil
}

func (c *copier) copySymlink(name string, st *unix.Stat_t) (bool, error) {
	target, err := readlinkat(c.srcCur, name)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EINVAL) {
		c.stats.Vanished++ // gone, or no longer a symlink
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("readlink: %w", err)
	}
	if err := unix.Symlinkat(target, c.dstCur, name); err != nil {
		return false, fmt.Errorf("symlink: %w", err)
	}
	if err := c.finishNamed(name, st, false); err != nil {
		return false, err
	}
	c.stats.Symlinks++
	return true, nil
}

func (c *copier) copySpecial(name string, st *unix.Stat_t) (bool, error) {
	if err := unix.Mknodat(c.dstCur, name, st.Mode&unix.S_IFMT|0o600, 0); err != nil {
		return false, fmt.Errorf("mknod: %w", err)
	}
	if err := c.finishNamed(name, st, true); err != nil {
		return false, err
	}
	c.stats.Special++
	return true, nil
}

// finishNamed gives the entry name just made in the current target directory, one that
// cannot be opened to be changed (a symlink, a FIFO, a socket), st's owner, mode (withMode:
// a symlink has none), attributes and times, through its name, without following it.
func (c *copier) finishNamed(name string, st *unix.Stat_t, withMode bool) error {
	if err := unix.Fchownat(c.dstCur, name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown to %d:%d: %w", st.Uid, st.Gid, err)
	}
	if withMode {
		// The name was made just now by mknod, in a directory only dirpv writes.
		if err := unix.Fchmodat(c.dstCur, name, st.Mode&0o7777, 0); err != nil {
			return fmt.Errorf("chmod to %o: %w", st.Mode&0o7777, err)
		}
	}
	if err := c.copyXattrs(namedXattrs(c.srcCur, name), namedXattrs(c.dstCur, name), name); err != nil {
		return err
	}
	times := statTimes(st)
	if err := unix.UtimesNanoAt(c.dstCur, name, times[:], unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

// setOwnerMode gives the file open at fd st's owner, then its mode: chown clears setuid and
// setgid, and the mode the file was made with went through the umask.
func setOwnerMode(fd int, st *unix.Stat_t) error {
	if err := unix.Fchown(fd, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown to %d:%d: %w", st.Uid, st.Gid, err)
	}
	if err := unix.Fchmod(fd, st.Mode&0o7777); err != nil {
		return fmt.Errorf("chmod to %o: %w", st.Mode&0o7777, err)
	}
	return nil
}

func statTimes(st *unix.Stat_t) [2]unix.Timespec { return [2]unix.Timespec{st.Atim, st.Mtim} }

// futimens sets the access and modification times of the file open at fd (utimensat with a
// NULL path, which unix.UtimesNanoAt cannot pass).
func futimens(fd int, ts *[2]unix.Timespec) error {
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(ts)), 0, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func readlinkat(dirFd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirFd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// xattrIO reads and writes the extended attributes of one file.
type xattrIO struct {
	list func([]byte) (int, error)
	get  func(string, []byte) (int, error)
	set  func(string, []byte) error
}

func fdXattrs(fd int) xattrIO {
	return xattrIO{
		list: func(b []byte) (int, error) { return unix.Flistxattr(fd, b) },
		get:  func(n string, b []byte) (int, error) { return unix.Fgetxattr(fd, n, b) },
		set:  func(n string, v []byte) error { return unix.Fsetxattr(fd, n, v, 0) },
	}
}

// namedXattrs reaches the file name in dirFd, which cannot be opened to be changed, through
// /proc/self/fd: the directory is the one open, and the last component is not followed.
func namedXattrs(dirFd int, name string) xattrIO {
	p := "/proc/self/fd/" + strconv.Itoa(dirFd) + "/" + name
	return xattrIO{
		list: func(b []byte) (int, error) { return unix.Llistxattr(p, b) },
		get:  func(n string, b []byte) (int, error) { return unix.Lgetxattr(p, n, b) },
		set:  func(n string, v []byte) error { return unix.Lsetxattr(p, n, v, 0) },
	}
}

// copyXattrs copies every extended attribute from src to dst but dirpv's own marker.
func (c *copier) copyXattrs(src, dst xattrIO, name string) error {
	names, err := readXattr(src.list, &c.xbuf)
	if xattrUnsupported(err) || errors.Is(err, unix.ENOENT) {
		return nil // none to read here (ENOENT: the name went meanwhile)
	}
	if err != nil {
		return fmt.Errorf("list extended attributes: %w", err)
	}
	for _, attr := range strings.Split(strings.TrimSuffix(string(names), "\x00"), "\x00") {
		if attr == "" || c.skipXattr[attr] {
			continue
		}
		val, err := readXattr(func(b []byte) (int, error) { return src.get(attr, b) }, &c.xbuf)
		if errors.Is(err, unix.ENODATA) || errors.Is(err, unix.ENOENT) {
			continue // removed meanwhile
		}
		if err != nil {
			return fmt.Errorf("read extended attribute %s: %w", attr, err)
		}
		switch err := dst.set(attr, val); {
		case err == nil:
		case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOTSUP):
			c.stats.XattrsSkipped++
			klog.FromContext(c.ctx).V(2).Info("Extended attribute not supported by the copy's file system, left out",
				"path", c.where(name), "attribute", attr)
		default:
			return fmt.Errorf("set extended attribute %s: %w", attr, err)
		}
	}
	return nil
}

// readXattr calls read with a buffer big enough for what it returns, kept in *buf; the result
// is only valid until the next call.
func readXattr(read func([]byte) (int, error), buf *[]byte) ([]byte, error) {
	for {
		if len(*buf) > 0 {
			n, err := read(*buf)
			if err == nil {
				return (*buf)[:n], nil
			}
			if !errors.Is(err, unix.ERANGE) {
				return nil, err
			}
		}
		n, err := read(nil)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return nil, nil
		}
		*buf = make([]byte, max(2*n, 256))
	}
}
