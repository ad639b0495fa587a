package volume

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// parentOf checks rel and opens its parent beneath the root as an O_PATH handle, which the
// caller closes; name is rel's last component.
func (r *Root) parentOf(rel string) (parentFd int, name string, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return -1, "", err
	}
	parent, name := split(rel)
	if parentFd, err = r.openDir(parent, unix.O_PATH); err != nil {
		return -1, "", err
	}
	return parentFd, name, nil
}

// split returns the parent of rel ("" for the base) and its last component.
func split(rel string) (string, string) {
	i := strings.LastIndexByte(rel, '/')
	if i < 0 {
		return "", rel
	}
	return rel[:i], rel[i+1:]
}

// Stat returns the status of the directory rel beneath the root, without following symlinks.
// It fails with an error wrapping os.ErrNotExist when rel does not exist.
func (r *Root) Stat(rel string) (unix.Stat_t, error) {
	var st unix.Stat_t
	fd, err := r.openDir(rel, unix.O_PATH)
	if err != nil {
		return st, err
	}
	defer unix.Close(fd)
	if err := unix.Fstat(fd, &st); err != nil {
		return st, fmt.Errorf("stat %s in %s: %w", rel, r.path, err)
	}
	return st, nil
}

// OpenDir opens the directory rel beneath the root as an O_PATH handle, for callers that must
// act on exactly this directory (bind mount source, statfs) without a second path lookup. A
// bind mount from /proc/<pid>/fd/<n> only keeps that promise with mount(8)'s
// --no-canonicalize, which stops mount from turning the link back into a path.
func (r *Root) OpenDir(rel string) (*os.File, error) {
	fd, err := r.openDir(rel, unix.O_PATH)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), r.path+"/"+rel), nil
}

// mountID identifies the mount an open file is on; unlike st_dev it tells a bind mount of the
// same file system apart.
func mountID(fd int) (uint64, error) {
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &stx); err != nil {
		return 0, fmt.Errorf("statx: %w", err)
	}
	if stx.Mask&unix.STATX_MNT_ID == 0 {
		return 0, fmt.Errorf("statx: kernel did not report a mount id")
	}
	return stx.Mnt_id, nil
}

// RemoveLink removes rel if it is no directory (a symlink planted where a volume was
// expected), never following it: the link goes, its target stays. A missing rel is not an
// error; a directory there now is left alone, with an error wrapping ErrReplaced.
func (r *Root) RemoveLink(rel string) error {
	parentFd, name, err := r.parentOf(rel)
	if err != nil {
		return err
	}
	defer unix.Close(parentFd)
	switch err := unix.Unlinkat(parentFd, name, 0); {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.EISDIR):
		return fmt.Errorf("%s in %s is a directory: %w", rel, r.path, ErrReplaced)
	default:
		return fmt.Errorf("unlink %s in %s: %w", rel, r.path, err)
	}
}

// Mkdir makes sure the directory rel exists beneath the root, creating it with mode (umask
// applies) if it is missing. Unlike MkdirAll it creates no parents and marks nothing: it is for
// dirpv's own directories, which are not volumes.
func (r *Root) Mkdir(rel string, mode uint32) error {
	parentFd, name, err := r.parentOf(rel)
	if err != nil {
		return err
	}
	defer unix.Close(parentFd)
	if err := unix.Mkdirat(parentFd, name, mode); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("mkdir %s in %s: %w", rel, r.path, err)
	}
	// An existing entry must be a real directory, not a symlink planted in its place.
	fd, err := r.openDir(rel, unix.O_PATH)
	if err != nil {
		return err
	}
	return unix.Close(fd)
}

// List returns the names in the directory rel beneath the root ("" for the base). A missing
// rel fails with an error wrapping os.ErrNotExist.
func (r *Root) List(rel string) ([]string, error) {
	fd, err := r.openDir(rel, unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	names, err := listNames(fd)
	if err != nil {
		return nil, fmt.Errorf("list %s in %s: %w", rel, r.path, err)
	}
	return names, nil
}

// listNames lists the directory open at fd, which must not have been read from: it is read
// through a duplicate sharing its offset (and its O_NOATIME), and fd stays open.
func listNames(fd int) ([]string, error) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	dir := os.NewFile(uintptr(dup), ".")
	defer dir.Close()
	return dir.Readdirnames(-1)
}
