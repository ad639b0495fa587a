package volume

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

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
	// xattr is the volume marker's attribute name; tests point it at an unsupported namespace
	// to exercise the record files NFS gets.
	xattr string
	// renameMu serialises check-then-rename where the file system has no RENAME_NOREPLACE
	// (NFS), so that two of this process's workers cannot both find a name free; a rename
	// onto an empty directory would otherwise replace it.
	renameMu sync.Mutex
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

// Owner is the mode and ownership a new volume directory gets. UID or GID -1 leaves that id as
// the creating process's.
type Owner struct {
	// Mode holds Unix permission bits, setuid, setgid and sticky included (0 to 07777).
	Mode uint32
	UID  int
	GID  int
}

// MkdirAll creates the volume directory rel for claim, and any missing parents, beneath the
// root. Parents get mode 0755 and the process's ownership; rel itself gets exactly owner.Mode
// (umask does not apply) and owner's ids, and a marker naming claim.
//
// The volume is made under a temporary reserved name, given its mode, owner and marker there,
// and only then renamed into place without replacing anything, so whatever crashes, rel is
// either absent or a complete, marked volume, and no volume can be created inside one that is
// still being made. What a crash leaves under the temporary name is removed by the next
// attempt for the same claim.
//
// It reports whether it created rel. If rel exists and its marker names claim (a retried
// Provision whose PV was never saved), it is adopted: left as it is, created false, no error.
// Otherwise it fails with an *ExistsError and changes nothing. It refuses (ErrInsideVolume) to
// descend into a directory marked as a volume, so that classes sharing a base with patterns of
// different depths cannot put one tenant's volume inside another's, and (ErrReservedName) paths
// through names dirpv keeps for itself.
func (r *Root) MkdirAll(rel string, owner Owner, claim Claim) (created bool, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return false, err
	}
	if err := checkReserved(rel); err != nil {
		return false, err
	}
	if claim.UID == "" {
		return false, fmt.Errorf("volume %s: the owning claim's UID is required", rel)
	}
	parentFd, err := r.openDir("", unix.O_PATH)
	if err != nil {
		return false, err
	}
	defer func() { unix.Close(parentFd) }()
	components := strings.Split(rel, "/")
	for i, name := range components[:len(components)-1] {
		where := strings.Join(components[:i+1], "/")
		err := unix.Mkdirat(parentFd, name, 0o755)
		made := err == nil
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return false, fmt.Errorf("mkdir %s in %s: %w", where, r.path, err)
		}
		fd, err := r.openChild(parentFd, name, where)
		if err != nil {
			return false, err
		}
		if made {
			// A fresh directory's inode may be a deleted volume's, whose record was left by a
			// crash; it names a volume that is gone.
			err = dropRecord(parentFd, fd)
		} else if m, merr := r.readMarker(parentFd, fd); merr != nil {
			err = merr
		} else if m.marked {
			err = ErrInsideVolume
		}
		unix.Close(parentFd)
		parentFd = fd
		if errors.Is(err, ErrInsideVolume) {
			return false, fmt.Errorf("%s in %s %w", where, r.path, err)
		} else if err != nil {
			return false, fmt.Errorf("%s in %s: %w", where, r.path, err)
		}
	}
	return r.createVolume(parentFd, components[len(components)-1], rel, owner, claim)
}

// openChild opens the directory name in parentFd for reading, refusing symlinks.
func (r *Root) openChild(parentFd int, name, where string) (int, error) {
	fd, err := unix.Openat2(parentFd, name, &unix.OpenHow{
		Flags:   uint64(unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: resolveBeneath,
	})
	if err != nil {
		return -1, describeResolveError(r.path, where, err)
	}
	return fd, nil
}

// createVolume makes the volume name in parentFd for claim, or adopts it if it is claim's.
func (r *Root) createVolume(parentFd int, name, rel string, owner Owner, claim Claim) (bool, error) {
	// An existing volume is judged before anything is made, so a refusal changes nothing.
	if err := r.adopt(parentFd, name, rel, claim); !errors.Is(err, os.ErrNotExist) {
		return false, err
	}
	mnt, err := mountID(parentFd)
	if err != nil {
		return false, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	tmp := tempName(claim, name)
	if err := removeVolumeAt(parentFd, tmp, mnt); err != nil {
		return false, fmt.Errorf("remove what an earlier attempt left of %s in %s: %w", rel, r.path, err)
	}
	if err := r.makeMarked(parentFd, tmp, owner, claim); err != nil {
		err = fmt.Errorf("%s in %s: %w", rel, r.path, err)
		if rerr := removeVolumeAt(parentFd, tmp, mnt); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the half-made directory: %w", rerr))
		}
		return false, err
	}
	err = r.renameNoReplace(parentFd, tmp, name)
	if err == nil {
		return true, nil
	}
	if rerr := removeVolumeAt(parentFd, tmp, mnt); rerr != nil {
		err = errors.Join(err, fmt.Errorf("remove the unused new directory: %w", rerr))
	}
	if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
		// Another worker made it meanwhile: the same judgement as above applies.
		return false, r.adopt(parentFd, name, rel, claim)
	}
	return false, fmt.Errorf("rename new volume into place as %s in %s: %w", rel, r.path, err)
}

// adopt returns nil if the directory name in parentFd is claim's volume, an error wrapping
// os.ErrNotExist if there is none, and an *ExistsError if it is not claim's.
func (r *Root) adopt(parentFd int, name, rel string, claim Claim) error {
	fd, err := r.openChild(parentFd, name, rel)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	m, err := r.readMarker(parentFd, fd)
	if err != nil {
		return fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	if !m.marked || m.owner.UID != claim.UID {
		return &ExistsError{Path: rel, Marked: m.marked, Owner: m.owner}
	}
	return nil
}

// makeMarked makes the directory name in parentFd with exactly owner's mode and ids, marked
// as claim's volume.
func (r *Root) makeMarked(parentFd int, name string, owner Owner, claim Claim) error {
	if err := unix.Mkdirat(parentFd, name, owner.Mode&0o777); err != nil {
		return fmt.Errorf("mkdir: %w", err)
	}
	fd, err := r.openChild(parentFd, name, name)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// chown first: it clears setuid/setgid, and mkdir applied the umask, so the mode is set
	// exactly afterwards.
	if err := unix.Fchown(fd, owner.UID, owner.GID); err != nil {
		return fmt.Errorf("chown to %d:%d: %w", owner.UID, owner.GID, err)
	}
	if err := unix.Fchmod(fd, owner.Mode&0o7777); err != nil {
		return fmt.Errorf("chmod to %o: %w", owner.Mode, err)
	}
	return r.writeMarker(parentFd, fd, claim)
}

// VolumeOwner returns the claim the marker of the volume directory rel names. marked is false
// if rel carries no marker; owner is empty if the marker names no claim (a volume made before
// dirpv recorded owners). It fails with an error wrapping os.ErrNotExist if rel does not exist.
func (r *Root) VolumeOwner(rel string) (owner Claim, marked bool, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return Claim{}, false, err
	}
	parent, name := split(rel)
	parentFd, err := r.openDir(parent, unix.O_PATH)
	if err != nil {
		return Claim{}, false, err
	}
	defer unix.Close(parentFd)
	fd, err := r.openChild(parentFd, name, rel)
	if err != nil {
		return Claim{}, false, err
	}
	defer unix.Close(fd)
	m, err := r.readMarker(parentFd, fd)
	if err != nil {
		return Claim{}, false, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	return m.owner, m.marked, nil
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
	if err := removeVolumeAt(parentFd, name, mnt); err != nil {
		return fmt.Errorf("remove %s in %s: %w", rel, r.path, err)
	}
	return nil
}

// removeVolumeAt removes name in parentFd as removeAt does, then its record file if it has one:
// afterwards, so that a volume whose removal fails stays marked. A crash in between leaves a
// record naming an inode that is gone; a directory made later with that inode drops or
// overwrites it.
func removeVolumeAt(parentFd int, name string, mnt uint64) error {
	var st unix.Stat_t
	err := unix.Fstatat(parentFd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat %s: %w", name, err)
	}
	if err := removeAt(parentFd, name, mnt); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil
	}
	return dropRecordOf(parentFd, st.Ino)
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
	if err := r.renameNoReplace(parentFd, name, newName); err != nil {
		return fmt.Errorf("rename %s to %s in %s: %w", rel, newName, r.path, err)
	}
	return nil
}

// renameNoReplace renames name to newName in parentFd, failing with EEXIST if newName exists.
// The volume's marker goes with it: the attribute is on the directory, a record file is named
// after its inode in the same parent.
func (r *Root) renameNoReplace(parentFd int, name, newName string) error {
	err := unix.Renameat2(parentFd, name, parentFd, newName, unix.RENAME_NOREPLACE)
	if !errors.Is(err, unix.EINVAL) {
		return err
	}
	// NFS (the kernel client, and so the test helper) has no RENAME_NOREPLACE. Check, then
	// rename, one at a time in this process; dirpv's NFS volumes are all made by the one
	// leader, so the race left is with a process outside dirpv writing the export.
	r.renameMu.Lock()
	defer r.renameMu.Unlock()
	var st unix.Stat_t
	switch serr := unix.Fstatat(parentFd, newName, &st, unix.AT_SYMLINK_NOFOLLOW); {
	case serr == nil:
		return unix.EEXIST
	case errors.Is(serr, unix.ENOENT):
		return unix.Renameat(parentFd, name, parentFd, newName)
	default:
		return serr
	}
}
