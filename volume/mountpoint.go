package volume

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// IsMountPoint reports whether the base directory the root holds open is where a file system
// (or a bind mount) is mounted: its mount differs from its parent directory's. Mount IDs, not
// device numbers: a btrfs subvolume has a device number of its own without being mounted
// anywhere, and a bind mount of a directory of the same file system has its parent's. The
// question is asked of the handle, not of the path, so no symlink is followed and no mount
// made or undone in between changes the answer for the directory dirpv is about to use.
func (r *Root) IsMountPoint() (bool, error) {
	var self, parent unix.Statx_t
	if err := unix.Statx(r.fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &self); err != nil {
		return false, fmt.Errorf("statx %s: %w", r.path, err)
	}
	// ".." of the root of a mount is the directory it is mounted on, in the mount beneath:
	// the kernel resolves it across the mount, whichever mounts are stacked there.
	if err := unix.Statx(r.fd, "..", unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &parent); err != nil {
		return false, fmt.Errorf("statx %s/..: %w", r.path, err)
	}
	if self.Mask&parent.Mask&unix.STATX_MNT_ID == 0 {
		// Not reached on the kernels dirpv starts on (CheckKernel).
		return false, fmt.Errorf("statx %s: the kernel reports no mount ID", r.path)
	}
	return self.Mnt_id != parent.Mnt_id, nil
}

// SameDirectory reports whether r and o hold the same directory of the same mount open.
func (r *Root) SameDirectory(o *Root) (bool, error) {
	const mask = unix.STATX_INO | unix.STATX_MNT_ID
	var a, b unix.Statx_t
	if err := unix.Statx(r.fd, "", unix.AT_EMPTY_PATH, mask, &a); err != nil {
		return false, fmt.Errorf("statx %s: %w", r.path, err)
	}
	if err := unix.Statx(o.fd, "", unix.AT_EMPTY_PATH, mask, &b); err != nil {
		return false, fmt.Errorf("statx %s: %w", o.path, err)
	}
	return a.Mnt_id == b.Mnt_id && a.Ino == b.Ino && a.Dev_major == b.Dev_major && a.Dev_minor == b.Dev_minor, nil
}
