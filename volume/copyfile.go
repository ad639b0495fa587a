package volume

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// copyFileStarted, if set, is called as the copy of each regular file starts: tests see
// how many are copied at once.
var copyFileStarted func()

func (c *copier) copyFile(name string, lst *unix.Stat_t) (bool, error) {
	if copyFileStarted != nil {
		copyFileStarted()
	}
	if lst.Size == 0 {
		return c.copyEmptyFile(name, lst)
	}
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
	return true, c.finishFile(dfd, &st, fdXattrs(sfd), name)
}

// copyEmptyFile copies the regular file name, empty when it was stat'ed (st), without opening
// it: there is no data to read, and on NFS the open and the close of the source are each a
// round trip, for what are often most of a tree's files. Its attributes are read through its
// name, never following it (namedXattrs). A file that was written meanwhile is copied as the
// stat saw it, empty, as a copy of a file written while it is copied may be; a name that is
// no longer a regular file (replaced by a symlink, a FIFO, a directory) is left out, as
// openSource leaves it out for a file with data.
func (c *copier) copyEmptyFile(name string, st *unix.Stat_t) (bool, error) {
	var stx unix.Statx_t
	switch err := unix.Statx(c.srcCur, name, unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, unix.STATX_TYPE|unix.STATX_MNT_ID, &stx); {
	case errors.Is(err, unix.ENOENT), err == nil && stx.Mask&unix.STATX_TYPE != 0 && uint32(stx.Mode)&unix.S_IFMT != unix.S_IFREG:
		c.stats.Vanished++
		return false, nil
	case err != nil:
		return false, fmt.Errorf("statx: %w", err)
	case stx.Mask&unix.STATX_TYPE == 0 || stx.Mask&unix.STATX_MNT_ID == 0:
		return false, fmt.Errorf("statx: kernel did not report a file type and a mount id")
	case stx.Mnt_id != c.srcMnt:
		return false, fmt.Errorf("%s %w", c.where(name), ErrMountInSource)
	}
	dfd, err := openBeneath(c.dstCur, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL)
	if err != nil {
		return false, fmt.Errorf("create: %w", err)
	}
	defer unix.Close(dfd)
	return true, c.finishFile(dfd, st, namedXattrs(c.srcCur, name), name)
}

// finishFile gives the file name just made and open at dfd st's owner, mode, attributes (read
// from src) and times, and counts it.
func (c *copier) finishFile(dfd int, st *unix.Stat_t, src xattrIO, name string) error {
	// chown before chmod: chown clears setuid and setgid, and file capabilities
	// (security.capability), which the attributes copied after it bring back.
	if err := setOwnerMode(dfd, st); err != nil {
		return err
	}
	if _, err := c.copyXattrs(src, fdXattrs(dfd), name, st); err != nil {
		return err
	}
	times := statTimes(st)
	if err := futimens(dfd, &times); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	c.stats.Files++
	c.stats.Bytes += st.Size
	return nil
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
			c.addBytes(size)
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
				c.addBytes(int64(got))
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
		c.addBytes(int64(got))
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
	if _, err := c.copyXattrs(namedXattrs(c.srcCur, name), namedXattrs(c.dstCur, name), name, st); err != nil {
		return err
	}
	times := statTimes(st)
	if err := unix.UtimesNanoAt(c.dstCur, name, times[:], unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

// setOwnerMode gives the file or directory open at fd, just made, st's owner, then its mode:
// chown clears setuid and setgid, and the mode the file was made with went through the umask.
func setOwnerMode(fd int, st *unix.Stat_t) error {
	// A file made by root is often already the source's (root's): a chown that changes
	// nothing is a round trip on NFS. The new file has no setuid, setgid or capability for
	// the chown to clear.
	var now unix.Stat_t
	if err := unix.Fstat(fd, &now); err != nil {
		return fmt.Errorf("stat: %w", err)
	}
	if now.Uid != st.Uid || now.Gid != st.Gid {
		if err := unix.Fchown(fd, int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("chown to %d:%d: %w", st.Uid, st.Gid, err)
		}
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

// copyXattrs copies every extended attribute from src, an entry of stat st, to dst but
// dirpv's own marker, and but an NFSv4 ACL that says no more than st's mode where the target
// directory hands none down (plainDir): dst, given that mode first, has that ACL already,
// and on NFS each attribute set is a round trip. It reports whether the source's NFSv4 ACL,
// as copied, hands entries down (handsDownACL).
func (c *copier) copyXattrs(src, dst xattrIO, name string, st *unix.Stat_t) (handsDown bool, err error) {
	names, err := readXattr(src.list, &c.xbuf)
	if xattrUnsupported(err) || errors.Is(err, unix.ENOENT) {
		return false, nil // none to read here (ENOENT: the name went meanwhile)
	}
	if err != nil {
		return false, fmt.Errorf("list extended attributes: %w", err)
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
			return false, fmt.Errorf("read extended attribute %s: %w", attr, err)
		}
		if attr == nfs4ACLXattr {
			handsDown = handsDownACL(val)
			if c.plainDir && modeOnlyACL(val, st.Mode) {
				continue
			}
		}
		switch err := dst.set(attr, val); {
		case err == nil:
		case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ENOTSUP):
			c.stats.XattrsSkipped++
			klog.FromContext(c.ctx).V(2).Info("Extended attribute not supported by the copy's file system, left out",
				"path", c.where(name), "attribute", attr)
		default:
			return false, fmt.Errorf("set extended attribute %s: %w", attr, err)
		}
	}
	return handsDown, nil
}

// modeOnlyTarget reports whether the directory open at fd, of mode, has no NFSv4 ACL (not on
// NFS, or a server without ACLs) or one that says no more than its mode (modeOnlyACL), and so
// hands none down; false if it cannot be read.
func modeOnlyTarget(fd int, mode uint32) bool {
	var buf []byte
	val, err := readXattr(func(b []byte) (int, error) { return unix.Fgetxattr(fd, nfs4ACLXattr, b) }, &buf)
	if errors.Is(err, unix.ENODATA) || xattrUnsupported(err) {
		return true
	}
	return err == nil && modeOnlyACL(val, mode)
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
