package volume

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// ErrNoRoomForCopy is returned by CheckRoomForCopy when the base's free space cannot hold the
// copy and the margin the admin keeps free. It is not ENOSPC: nothing was written, and the
// same copy may fit once space is freed.
var ErrNoRoomForCopy = errors.New("not enough free space on the base for the copy")

// NoRoomError says how much a copy needs and how much is free.
type NoRoomError struct {
	// Need is the source's usage plus the margin; Free is the base's available space.
	Need, Free, Margin uint64
}

func (e *NoRoomError) Error() string {
	return fmt.Sprintf("%s: it needs %d bytes (the source's usage and a margin of %d bytes kept free), %d bytes are free",
		ErrNoRoomForCopy, e.Need, e.Margin, e.Free)
}

func (e *NoRoomError) Unwrap() error { return ErrNoRoomForCopy }

// maxSizeDepth bounds how deep SourceUsage walks: it holds a directory open per level.
const maxSizeDepth = 4096

// CheckRoomForCopy fails with a *NoRoomError (ErrNoRoomForCopy) unless the base of r has free
// at least the space src occupies plus margin bytes, so that a copy that cannot complete is
// not started: it would fill the base for every volume on it, and its retry would fill it
// again. A copy that shares its source's data (a btrfs snapshot, reflinks: same file system,
// one that clones files) needs almost no space and is not checked. Over NFS both sides are
// the server's; callers bound the call as any other on an export.
func (r *Root) CheckRoomForCopy(ctx context.Context, src Source, margin uint64) error {
	srcFd, err := openSourceDir(src.Root, src.Rel)
	if err != nil {
		return fmt.Errorf("copy source: %w", err)
	}
	defer unix.Close(srcFd)
	if shares, err := r.sharesData(srcFd); err != nil || shares {
		return err
	}
	used, err := sourceUsage(ctx, src.Root, srcFd)
	if err != nil {
		return fmt.Errorf("size the copy source %s in %s: %w", src.Rel, src.Root.path, err)
	}
	free, err := r.Available()
	if err != nil {
		return err
	}
	if need := used + margin; need > free {
		return &NoRoomError{Need: need, Free: free, Margin: margin}
	}
	return nil
}

// sharesData reports whether a copy of the tree at srcFd into r shares its data: both on one
// file system that clones files (FICLONE), probed with two unnamed files that vanish on close.
func (r *Root) sharesData(srcFd int) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Fstat(srcFd, &a); err != nil {
		return false, fmt.Errorf("stat the copy source: %w", err)
	}
	if err := unix.Fstat(r.fd, &b); err != nil {
		return false, fmt.Errorf("stat %s: %w", r.path, err)
	}
	if a.Dev != b.Dev {
		return false, nil
	}
	from, err := unix.Openat(r.fd, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false, nil // no unnamed files (NFS): not known to clone
	}
	defer unix.Close(from)
	to, err := unix.Openat(r.fd, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return false, nil
	}
	defer unix.Close(to)
	return unix.IoctlFileClone(to, from) == nil, nil
}

// sourceUsage is the space the tree at srcFd occupies: its limit's usage where it is a volume
// with one, else the blocks of everything in it, walked without following symlinks or
// crossing into other file systems. A hard-linked file counts once per name, as a copy whose
// hard-link table is full writes it.
func sourceUsage(ctx context.Context, root *Root, srcFd int) (uint64, error) {
	if id, ok, err := VolumeQuota(srcFd); err == nil && ok {
		if fs, err := root.Quota(); err == nil {
			if u, err := fs.Usage(srcFd, id); err == nil {
				return u.UsedBytes, nil
			}
		}
	}
	return walkUsage(ctx, srcFd)
}

// walkUsage sums the blocks of the tree at fd, reading each directory a buffer at a time and
// keeping, per level, a descriptor and where to read on: bounded memory whatever the names.
func walkUsage(ctx context.Context, fd int) (uint64, error) {
	var top unix.Stat_t
	if err := unix.Fstat(fd, &top); err != nil {
		return 0, fmt.Errorf("stat: %w", err)
	}
	root, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("open: %w", err)
	}
	type level struct {
		fd  int
		off int64
	}
	stack := []level{{fd: root}}
	defer func() {
		for _, l := range stack {
			unix.Close(l.fd)
		}
	}()
	used := uint64(top.Blocks) * 512
	var rd dirReader
	var batch []dirent
	entries := 0
	for len(stack) > 0 {
		cur := &stack[len(stack)-1]
		batch, err = rd.read(cur.fd, cur.off, batch, dirBatch)
		if err != nil {
			return 0, fmt.Errorf("read directory: %w", err)
		}
		if len(batch) == 0 {
			unix.Close(cur.fd)
			stack = stack[:len(stack)-1]
			continue
		}
		for _, e := range batch {
			// Read on from just past this entry next time, a child's tree done.
			cur.off = e.off
			if entries++; entries%1000 == 0 {
				if err := ctx.Err(); err != nil {
					return 0, err
				}
			}
			var st unix.Stat_t
			if err := unix.Fstatat(cur.fd, e.name, &st, unix.AT_SYMLINK_NOFOLLOW); errors.Is(err, unix.ENOENT) {
				continue // removed meanwhile
			} else if err != nil {
				return 0, fmt.Errorf("stat %s: %w", e.name, err)
			}
			used += uint64(st.Blocks) * 512
			if st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Dev != top.Dev {
				continue
			}
			if len(stack) >= maxSizeDepth {
				return 0, fmt.Errorf("deeper than %d directories", maxSizeDepth)
			}
			child, err := openBeneath(cur.fd, e.name, unix.O_RDONLY|unix.O_DIRECTORY)
			if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
				continue // replaced meanwhile
			} else if err != nil {
				return 0, fmt.Errorf("open %s: %w", e.name, err)
			}
			stack = append(stack, level{fd: child})
			break
		}
	}
	return used, nil
}
