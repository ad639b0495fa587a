package volume

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// resolveBeneath makes the kernel refuse any lookup that would leave the directory it starts
// from or pass through a symlink (openat2(2)), so a symlink planted inside a volume can never
// redirect dirpv to a path outside it, however it is raced.
const resolveBeneath = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// ErrNotDirectory is returned when a path component dirpv would descend into is not a directory,
// for example a symlink planted where a volume directory was expected.
var ErrNotDirectory = errors.New("not a directory (symlinks are never followed)")

// Root is an open base directory. Every operation on it resolves beneath it without following
// symlinks. It is not safe to Close while operations run.
type Root struct {
	path string
	fd   int
}

// OpenRoot opens the base directory at an absolute path. The base itself may be reached through
// symlinks (an admin's choice); nothing beneath it is.
func OpenRoot(path string) (*Root, error) {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open base directory %s: %w", path, err)
	}
	return &Root{path: path, fd: fd}, nil
}

// Path is the base directory's path as given to OpenRoot.
func (r *Root) Path() string { return r.path }

// Close releases the base directory.
func (r *Root) Close() error { return unix.Close(r.fd) }

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

// split returns the parent of rel ("" for the base) and its last component.
func split(rel string) (string, string) {
	i := strings.LastIndexByte(rel, '/')
	if i < 0 {
		return "", rel
	}
	return rel[:i], rel[i+1:]
}

// ErrInsideVolume is returned by MkdirAll when a directory it would descend into is itself a
// volume: one volume is never created inside another.
var ErrInsideVolume = errors.New("is another volume's directory; a volume is never created inside another")

// volumeMarker is the extended attribute MkdirAll puts on each volume directory it creates. It
// is in the trusted namespace, which needs CAP_SYS_ADMIN to read or write: a pod can neither
// forge it on a directory of its own nor strip it from its volume. File systems without
// trusted attributes (NFS) go unmarked.
const volumeMarker = "trusted.dirpv.volume"

// isVolume reports whether the open directory carries the volume marker.
func isVolume(fd int) bool {
	_, err := unix.Fgetxattr(fd, volumeMarker, nil)
	return err == nil
}

// markVolume puts the volume marker on the open directory. It is best effort: where the file
// system has no trusted attributes (NFS) or the process lacks CAP_SYS_ADMIN, the volume goes
// unmarked rather than failing after the directory exists.
func markVolume(fd int) {
	_ = unix.Fsetxattr(fd, volumeMarker, []byte("1"), 0)
}

// Owner is the mode and ownership a new volume directory gets. UID or GID -1 leaves that id as
// the creating process's.
type Owner struct {
	// Mode holds Unix permission bits, setuid, setgid and sticky included (0 to 07777).
	Mode uint32
	UID  int
	GID  int
}

// MkdirAll creates the volume directory rel and any missing parents beneath the root. Parents
// get mode 0755 and the process's ownership; rel itself gets exactly owner.Mode (umask does not
// apply) and owner's ids, and is marked as a volume. It reports whether rel was created; an
// existing directory is left as it is. It refuses (ErrInsideVolume) to descend into a
// directory marked as a volume, so that classes sharing a base with patterns of different
// depths cannot put one tenant's volume inside another's.
func (r *Root) MkdirAll(rel string, owner Owner) (created bool, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return false, err
	}
	parentFd, err := r.openDir("", unix.O_PATH)
	if err != nil {
		return false, err
	}
	defer func() { unix.Close(parentFd) }()
	components := strings.Split(rel, "/")
	for i, name := range components {
		last := i == len(components)-1
		mode := uint32(0o755)
		if last {
			mode = owner.Mode & 0o777
		}
		err := unix.Mkdirat(parentFd, name, mode)
		made := err == nil
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("mkdir %s in %s: %w", strings.Join(components[:i+1], "/"), r.path, err)
		}
		fd, err := unix.Openat2(parentFd, name, &unix.OpenHow{
			Flags:   uint64(unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC),
			Resolve: resolveBeneath,
		})
		if err != nil {
			return false, describeResolveError(r.path, strings.Join(components[:i+1], "/"), err)
		}
		unix.Close(parentFd)
		parentFd = fd
		if !last && isVolume(fd) {
			return false, fmt.Errorf("%s in %s %w", strings.Join(components[:i+1], "/"), r.path, ErrInsideVolume)
		}
		if last && made {
			// chown first: it clears setuid/setgid, and mkdir applied the umask, so the mode is
			// set exactly afterwards.
			if err := unix.Fchown(fd, owner.UID, owner.GID); err != nil {
				return true, fmt.Errorf("chown %s in %s to %d:%d: %w", rel, r.path, owner.UID, owner.GID, err)
			}
			if err := unix.Fchmod(fd, owner.Mode&0o7777); err != nil {
				return true, fmt.Errorf("chmod %s in %s to %o: %w", rel, r.path, owner.Mode, err)
			}
			markVolume(fd)
			return true, nil
		}
	}
	return false, nil
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

// RemoveAll removes rel and everything below it. It never follows a symlink (a symlink is
// removed, its target untouched) and never crosses a mount point, bind mounts of the same file
// system included: one inside the tree stops the removal with an error, so a still-mounted
// volume or a mount planted inside it cannot lead to deleting someone else's data. A missing
// rel is not an error.
func (r *Root) RemoveAll(rel string) error {
	if _, err := CleanRelPath(rel); err != nil {
		return err
	}
	parent, name := split(rel)
	parentFd, err := r.openDir(parent, unix.O_RDONLY)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(parentFd)
	mnt, err := mountID(parentFd)
	if err != nil {
		return fmt.Errorf("%s in %s: %w", parent, r.path, err)
	}
	if err := removeAt(parentFd, name, mnt); err != nil {
		return fmt.Errorf("remove %s in %s: %w", rel, r.path, err)
	}
	return nil
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

// removeAt removes name in parentFd and everything below it. It walks the tree holding one
// directory open at a time, whatever its depth: a tenant decides how deep its volume is, and
// one descriptor per level would let it exhaust the process's descriptors (failing this
// removal forever and starving everything else the process does meanwhile). Going back up
// uses "..", checked against the device and inode recorded on the way down, so a directory
// moved during the walk stops it instead of leading it elsewhere.
func removeAt(parentFd int, name string, mnt uint64) error {
	err := unix.Unlinkat(parentFd, name, 0)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case !errors.Is(err, unix.EISDIR):
		return fmt.Errorf("unlink %s: %w", name, err)
	}
	type level struct {
		name     string
		dev, ino uint64
		// children still to remove.
		children []string
	}
	var stack []level
	where := func(child string) string {
		var b strings.Builder
		for _, l := range stack {
			b.WriteString(l.name)
			b.WriteByte('/')
		}
		b.WriteString(child)
		return b.String()
	}
	// descend opens the directory child of fd, checks it is on the same mount, lists it and
	// makes it the current level. It reports false if child is gone.
	descend := func(fd int, child string) (int, bool, error) {
		cfd, err := unix.Openat(fd, child, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOENT) {
			return -1, false, nil
		}
		if err != nil {
			return -1, false, fmt.Errorf("open %s: %w", where(child), err)
		}
		fail := func(err error) (int, bool, error) {
			unix.Close(cfd)
			return -1, false, err
		}
		if id, err := mountID(cfd); err != nil {
			return fail(fmt.Errorf("%s: %w", where(child), err))
		} else if id != mnt {
			return fail(fmt.Errorf("%s is a mount point, refusing to remove across it", where(child)))
		}
		var st unix.Stat_t
		if err := unix.Fstat(cfd, &st); err != nil {
			return fail(fmt.Errorf("stat %s: %w", where(child), err))
		}
		names, err := readDirNames(cfd)
		if err != nil {
			return fail(fmt.Errorf("read directory %s: %w", where(child), err))
		}
		stack = append(stack, level{name: child, dev: st.Dev, ino: st.Ino, children: names})
		return cfd, true, nil
	}
	cur, ok, err := descend(parentFd, name)
	if err != nil || !ok {
		return err
	}
	defer func() {
		if cur >= 0 {
			unix.Close(cur)
		}
	}()
	for len(stack) > 0 {
		top := &stack[len(stack)-1]
		if n := len(top.children); n > 0 {
			child := top.children[n-1]
			top.children = top.children[:n-1]
			err := unix.Unlinkat(cur, child, 0)
			switch {
			case err == nil, errors.Is(err, unix.ENOENT):
				continue
			case !errors.Is(err, unix.EISDIR):
				return fmt.Errorf("unlink %s: %w", where(child), err)
			}
			cfd, ok, err := descend(cur, child)
			if err != nil {
				return err
			}
			if ok {
				unix.Close(cur)
				cur = cfd
			}
			continue
		}
		// The current directory is empty: go back to its parent and remove it there.
		done := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if len(stack) == 0 {
			if err := unix.Unlinkat(parentFd, done.name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("rmdir %s: %w", done.name, err)
			}
			return nil
		}
		pfd, err := unix.Openat(cur, "..", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", where(""), err)
		}
		unix.Close(cur)
		cur = pfd
		var st unix.Stat_t
		if err := unix.Fstat(cur, &st); err != nil {
			return fmt.Errorf("stat %s: %w", where(""), err)
		}
		if parent := stack[len(stack)-1]; st.Dev != parent.dev || st.Ino != parent.ino {
			return fmt.Errorf("%s was moved while it was being removed, stopping", where(done.name))
		}
		if err := unix.Unlinkat(cur, done.name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("rmdir %s: %w", where(done.name), err)
		}
	}
	return nil
}

// readDirNames lists the directory open at fd, without closing fd.
func readDirNames(fd int) ([]string, error) {
	dup, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	dir := os.NewFile(uintptr(dup), ".")
	defer dir.Close()
	return dir.Readdirnames(-1)
}

// Rename moves the directory rel to newName in the same parent directory, failing if newName
// exists. Only the last component changes, so the volume can never move out of its parent.
func (r *Root) Rename(rel, newName string) error {
	if _, err := CleanRelPath(rel); err != nil {
		return err
	}
	if _, err := CleanRelPath(newName); err != nil || strings.Contains(newName, "/") {
		return fmt.Errorf("new name %q must be a single path component", newName)
	}
	parent, name := split(rel)
	parentFd, err := r.openDir(parent, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(parentFd)
	err = unix.Renameat2(parentFd, name, parentFd, newName, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) {
		// NFS (the kernel client, and so the test helper) has no RENAME_NOREPLACE. Check,
		// then rename: newName is dirpv's own, unique per volume and second, so the race
		// between the two is only with another dirpv archiving the same volume.
		var st unix.Stat_t
		switch serr := unix.Fstatat(parentFd, newName, &st, unix.AT_SYMLINK_NOFOLLOW); {
		case serr == nil:
			err = unix.EEXIST
		case errors.Is(serr, unix.ENOENT):
			err = unix.Renameat(parentFd, name, parentFd, newName)
		default:
			err = serr
		}
	}
	if err != nil {
		return fmt.Errorf("rename %s to %s in %s: %w", rel, newName, r.path, err)
	}
	return nil
}
