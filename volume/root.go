package volume

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

// resolveBeneath makes the kernel refuse any lookup that would leave the directory it starts
// from or pass through a symlink (openat2(2)), so a symlink planted inside a volume can never
// redirect dirpv to a path outside it, however it is raced.
const resolveBeneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// ErrNotDirectory is returned when a path component dirpv would descend into is not a directory,
// for example a symlink planted where a volume directory was expected.
var ErrNotDirectory = errors.New("not a directory (symlinks are never followed)")

// Root is an open base directory. Every operation on it resolves beneath it without following
// symlinks. It is not safe to Close while operations run, but for the long ones, MkdirAllFrom
// and Snapshot, once they have started.
type Root struct {
	path string
	fd   int
	// xattr is the volume marker's attribute name; tests point it at an unsupported namespace
	// to exercise the record files NFS gets.
	xattr string
	// quotaFS is what the base's file system enforces, once it enforces something (Quota).
	quotaMu sync.Mutex
	quotaFS *quota.FS
}

// OpenRoot opens the base directory at an absolute path. The base itself may be reached through
// symlinks (an admin's choice); nothing beneath it is.
func OpenRoot(path string) (*Root, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open base directory %s: %w", path, err)
	}
	return &Root{path: path, fd: fd, xattr: volumeMarker}, nil
}

// Path is the base directory's path as given to OpenRoot.
func (r *Root) Path() string { return r.path }

// Close releases the base directory.
func (r *Root) Close() error { return unix.Close(r.fd) }

// Moved reports whether the root's path now names another directory than the one the root
// holds open: a file system mounted on it (or on a directory above it) since it was opened, or
// the directory replaced. A root kept open across such a change would keep writing to the
// directory underneath, hidden from everyone else.
func (r *Root) Moved() (bool, error) {
	const mask = unix.STATX_INO | unix.STATX_MNT_ID
	var held, named unix.Statx_t
	if err := unix.Statx(r.fd, "", unix.AT_EMPTY_PATH, mask, &held); err != nil {
		return false, fmt.Errorf("statx %s: %w", r.path, err)
	}
	// Following symlinks: an admin may reach the base through one; what matters is where the
	// path leads now.
	if err := unix.Statx(unix.AT_FDCWD, r.path, 0, mask, &named); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return true, nil
		}
		return false, fmt.Errorf("statx %s: %w", r.path, err)
	}
	return held.Mnt_id != named.Mnt_id || held.Ino != named.Ino ||
		held.Dev_major != named.Dev_major || held.Dev_minor != named.Dev_minor, nil
}

// Available is the space, in bytes, that unprivileged writers can still use on the base's file
// system (statfs f_bavail): what a new or a grown volume there can count on. Over NFS the call
// goes to the server, so callers bound it as they bound every other call on an export.
func (r *Root) Available() (uint64, error) {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(r.fd, &sfs); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", r.path, err)
	}
	return sfs.Bavail * uint64(sfs.Bsize), nil
}

// openDir opens rel (a clean relative path, or "" for the base itself) as a directory beneath
// the root.
func (r *Root) openDir(rel string, flags int) (int, error) {
	if rel == "" {
		rel = "."
	} else if _, err := CleanRelPath(rel); err != nil {
		return -1, err
	}
	fd, err := unix.Openat2(r.fd, rel, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: resolveBeneath,
	})
	if err != nil {
		return -1, describeResolveError(r.path, rel, err)
	}
	return fd, nil
}

func describeResolveError(base, rel string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENOTDIR):
		return fmt.Errorf("%s in %s: %w", rel, base, ErrNotDirectory)
	case errors.Is(err, unix.EXDEV):
		return fmt.Errorf("%s escapes %s: %w", rel, base, err)
	}
	return fmt.Errorf("open %s in %s: %w", rel, base, &os.PathError{Op: "openat2", Path: rel, Err: err})
}

// Dup returns a second handle on the same base directory, closed independently, so that a
// caller can keep using the base after its owner closed its own handle.
func (r *Root) Dup() (*Root, error) {
	fd, err := unix.FcntlInt(uintptr(r.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate handle on %s: %w", r.path, err)
	}
	return &Root{path: r.path, fd: fd, xattr: r.xattr}, nil
}
