package volume

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/internal/keyed"
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
	created, _, err = r.mkdirAll(rel, owner, claim, 0, nil)
	return created, err
}

// MkdirAllLimited is MkdirAll for a volume limited to limit bytes by the base's file system
// (see Quota). The limit is set on the volume while it still has its temporary name, before
// its marker, which records the quota's ID, so no volume exists in place without its limit.
// It returns the ID; an adopted volume returns the one its marker names, which is empty if
// it was made without a limit. It fails, changing nothing, if the file system cannot enforce
// limits (the error wraps quota.ErrNotEnforceable).
func (r *Root) MkdirAllLimited(rel string, owner Owner, claim Claim, limit uint64) (created bool, id quota.ID, err error) {
	if limit == 0 {
		return false, quota.ID{}, fmt.Errorf("volume %s: a limit of 0 bytes", rel)
	}
	fs, err := r.Quota()
	if err != nil {
		return false, quota.ID{}, err
	}
	if err := fs.Enforces(); err != nil {
		return false, quota.ID{}, fmt.Errorf("base %s: %w", r.path, err)
	}
	return r.mkdirAll(rel, owner, claim, limit, nil)
}

// Quota probes what the base's file system can enforce. A file system that enforces limits
// is probed once. One that cannot, or a probe that fails, is probed again on the next call:
// an admin who runs `btrfs quota enable`, or remounts with prjquota, under a running node gets
// limits (and capacity for classes that require them) at once, not after a restart. A probe is
// a statfs and an ioctl, cheap beside the work that asks for it.
func (r *Root) Quota() (*quota.FS, error) {
	r.quotaMu.Lock()
	defer r.quotaMu.Unlock()
	if r.quotaFS != nil {
		return r.quotaFS, nil
	}
	fd, err := r.openDir("", unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	fs, err := quota.Probe(fd)
	if err != nil {
		return nil, fmt.Errorf("base %s: %w", r.path, err)
	}
	if fs.Enforces() == nil {
		r.quotaFS = fs
	}
	return fs, nil
}

// RemoveLimited removes the volume rel, limited by id, as RemoveAll does, and gives its limit
// back so the ID can be used again: the limit is cleared while the directory still carries id
// (quota.FS.Unlimit), then the tree goes, then what is left of the quota is released. A
// missing rel (a retried Delete) only gets the Release.
func (r *Root) RemoveLimited(rel string, id quota.ID) error {
	fs, err := r.Quota()
	if err != nil {
		return err
	}
	fd, err := r.openDir(rel, unix.O_RDONLY)
	switch {
	case err == nil:
		err = fs.Unlimit(fd, id)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("%s in %s: clear its size limit: %w", rel, r.path, err)
		}
	case !errors.Is(err, unix.ENOENT) && !errors.Is(err, ErrNotDirectory):
		return err
	}
	if err := r.RemoveAll(rel); err != nil {
		return err
	}
	return r.ReleaseQuota(id)
}

// ReleaseQuota clears the limit of a volume that is gone, so its ID can be used again.
func (r *Root) ReleaseQuota(id quota.ID) error {
	fs, err := r.Quota()
	if err != nil {
		return err
	}
	fd, err := r.openDir("", unix.O_RDONLY)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := fs.Release(fd, id); err != nil {
		return fmt.Errorf("base %s: %w", r.path, err)
	}
	return nil
}

// mkdirAll is MkdirAll with a limit of limit bytes, none if 0, for a volume that starts as a
// copy of from (nil: empty).
func (r *Root) mkdirAll(rel string, owner Owner, claim Claim, limit uint64, from *copyFrom) (created bool, id quota.ID, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return false, quota.ID{}, err
	}
	if err := checkReserved(rel); err != nil {
		return false, quota.ID{}, err
	}
	if claim.UID == "" {
		return false, quota.ID{}, fmt.Errorf("volume %s: the owning claim's UID is required", rel)
	}
	// Read-only, not O_PATH: a btrfs subvolume is created by an ioctl on its parent.
	parentFd, err := r.openDir("", unix.O_RDONLY)
	if err != nil {
		return false, quota.ID{}, err
	}
	defer func() { unix.Close(parentFd) }()
	components := strings.Split(rel, "/")
	for i, name := range components[:len(components)-1] {
		where := strings.Join(components[:i+1], "/")
		err := unix.Mkdirat(parentFd, name, 0o755)
		made := err == nil
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return false, quota.ID{}, fmt.Errorf("mkdir %s in %s: %w", where, r.path, err)
		}
		fd, err := r.openChild(parentFd, name, where)
		if err != nil {
			return false, quota.ID{}, err
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
			return false, quota.ID{}, fmt.Errorf("%s in %s %w", where, r.path, err)
		} else if err != nil {
			return false, quota.ID{}, fmt.Errorf("%s in %s: %w", where, r.path, err)
		}
	}
	return r.createVolume(parentFd, components[len(components)-1], rel, owner, claim, limit, from)
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

// createVolume makes the volume name in parentFd for claim, limited to limit bytes (0: no
// limit) and filled from from (nil: empty), or adopts it if it is claim's.
func (r *Root) createVolume(parentFd int, name, rel string, owner Owner, claim Claim, limit uint64, from *copyFrom) (bool, quota.ID, error) {
	tmp := tempName(claim, name)
	if err := r.dropPlaceholder(parentFd, name, tmp, claim); err != nil {
		return false, quota.ID{}, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	// An existing volume is judged before anything is made, so a refusal changes nothing.
	if id, err := r.adopt(parentFd, name, rel, claim); !errors.Is(err, os.ErrNotExist) {
		return false, id, err
	}
	mnt, err := mountID(parentFd)
	if err != nil {
		return false, quota.ID{}, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	if err := r.removeTemp(parentFd, tmp, mnt, limit); err != nil {
		return false, quota.ID{}, fmt.Errorf("remove what an earlier attempt left of %s in %s: %w", rel, r.path, err)
	}
	id, err := r.makeMarked(parentFd, tmp, owner, claim, limit, from)
	if err != nil {
		err = fmt.Errorf("%s in %s: %w", rel, r.path, err)
		if rerr := r.removeTemp(parentFd, tmp, mnt, limit); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the half-made directory: %w", rerr))
		}
		return false, quota.ID{}, err
	}
	failpoint.Hit(failpoint.BeforeRename)
	err = r.renameNoReplace(parentFd, tmp, parentFd, name)
	if err == nil {
		return true, id, nil
	}
	if rerr := r.removeTemp(parentFd, tmp, mnt, limit); rerr != nil {
		err = errors.Join(err, fmt.Errorf("remove the unused new directory: %w", rerr))
	}
	if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
		// Another worker made it meanwhile: the same judgement as above applies.
		id, err := r.adopt(parentFd, name, rel, claim)
		return false, id, err
	}
	return false, quota.ID{}, fmt.Errorf("rename new volume into place as %s in %s: %w", rel, r.path, err)
}

// dropPlaceholder removes what a crash inside renameNoReplace's NFS path leaves at name: the
// empty mode-0 directory that claimed the name, beside claim's own marked temporary directory
// tmp, which was about to be renamed over it. Without this the claim's every retry found a
// directory that is no volume and was refused for good (a leader killed at that instant,
// TestControllerLeaderKilledMidway). Anything else at name is left for adopt to judge; rmdir
// removes only an empty directory.
func (r *Root) dropPlaceholder(parentFd int, name, tmp string, claim Claim) error {
	var st unix.Stat_t
	if err := unix.Fstatat(parentFd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil ||
		st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Mode&0o7777 != 0 {
		return nil
	}
	fd, err := r.openChild(parentFd, tmp, tmp)
	if err != nil {
		return nil
	}
	defer unix.Close(fd)
	if m, err := r.readMarker(parentFd, fd); err != nil || !m.marked || m.owner.UID != claim.UID {
		return nil
	}
	if err := unix.Unlinkat(parentFd, name, unix.AT_REMOVEDIR); err != nil &&
		!errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove the placeholder a crash left at %s: %w", name, err)
	}
	return nil
}

// removeTemp removes the temporary directory tmp in parentFd, made or left by an attempt
// with the same limit (0: none), and gives back the limit it got, if any, as RemoveLimited
// does. Nothing else would: it has no marker, or one no PV names, and a limit left on a
// project with no files is never cleared nor handed out again.
func (r *Root) removeTemp(parentFd int, tmp string, mnt, limit uint64) error {
	var fs *quota.FS
	var id quota.ID
	if limit > 0 {
		var err error
		if fs, err = r.Quota(); err != nil {
			return err
		}
		fd, err := r.openChild(parentFd, tmp, tmp)
		switch {
		case err == nil:
			var ok bool
			id, ok, err = fs.IDOf(parentFd, fd)
			if err == nil && ok {
				err = fs.Unlimit(fd, id)
			} else if !ok {
				id = quota.ID{}
			}
			unix.Close(fd)
			if err != nil {
				return fmt.Errorf("%s: size limit: %w", tmp, err)
			}
		case errors.Is(err, unix.ENOENT):
			return nil
		case !errors.Is(err, ErrNotDirectory):
			return err
		}
		// Not a directory: nothing dirpv made, so no limit of dirpv's; removed all the same.
	}
	if err := removeVolumeAt(parentFd, tmp, mnt); err != nil {
		return err
	}
	if id.Kind == "" {
		return nil
	}
	if err := fs.Release(parentFd, id); err != nil {
		return fmt.Errorf("%s: release its size limit: %w", tmp, err)
	}
	return nil
}

// adopt returns the quota ID of the directory name in parentFd if it is claim's volume, an
// error wrapping os.ErrNotExist if there is none, and an *ExistsError if it is not claim's.
func (r *Root) adopt(parentFd int, name, rel string, claim Claim) (quota.ID, error) {
	fd, err := r.openChild(parentFd, name, rel)
	if err != nil {
		return quota.ID{}, err
	}
	defer unix.Close(fd)
	m, err := r.readMarker(parentFd, fd)
	if err != nil {
		return quota.ID{}, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	if !m.marked || m.owner.UID != claim.UID {
		return quota.ID{}, &ExistsError{Path: rel, Marked: m.marked, Owner: m.owner}
	}
	if m.quota == "" {
		return quota.ID{}, nil
	}
	id, err := quota.ParseID(m.quota)
	if err != nil {
		return quota.ID{}, fmt.Errorf("%s in %s: volume marker: %w", rel, r.path, err)
	}
	return id, nil
}

// makeMarked makes the directory name in parentFd with exactly owner's mode and ids and a
// limit of limit bytes (0: none), marked as claim's volume, and fills it from from (nil:
// left empty), whose root's mode and ids it then takes instead of owner's.
func (r *Root) makeMarked(parentFd int, name string, owner Owner, claim Claim, limit uint64, from *copyFrom) (quota.ID, error) {
	if from != nil {
		if err := from.open(); err != nil {
			return quota.ID{}, err
		}
		owner = from.owner
	}
	var fs *quota.FS
	snapshot := false
	if limit > 0 {
		var err error
		if fs, err = r.Quota(); err != nil {
			return quota.ID{}, err
		}
		if snapshot, err = from.snapshot(fs, parentFd, name); err != nil {
			return quota.ID{}, err
		}
		if !snapshot {
			if err := fs.Mkdir(parentFd, name, owner.Mode&0o777); err != nil {
				return quota.ID{}, err
			}
		}
	} else if err := unix.Mkdirat(parentFd, name, owner.Mode&0o777); err != nil {
		return quota.ID{}, fmt.Errorf("mkdir: %w", err)
	}
	fd, err := r.openChild(parentFd, name, name)
	if err != nil {
		return quota.ID{}, err
	}
	defer unix.Close(fd)
	// chown first: it clears setuid/setgid, and mkdir applied the umask, so the mode is set
	// exactly afterwards.
	if err := unix.Fchown(fd, owner.UID, owner.GID); err != nil {
		return quota.ID{}, fmt.Errorf("chown to %d:%d: %w", owner.UID, owner.GID, err)
	}
	if err := unix.Fchmod(fd, owner.Mode&0o7777); err != nil {
		return quota.ID{}, fmt.Errorf("chmod to %o: %w", owner.Mode, err)
	}
	var id quota.ID
	if fs != nil {
		failpoint.Hit(failpoint.BeforeLimit)
		if id, err = fs.SetLimit(fd, limit); err != nil {
			return quota.ID{}, fmt.Errorf("set size limit: %w", err)
		}
		if snapshot {
			if err := checkFits(fs, fd, id); err != nil {
				return quota.ID{}, err
			}
		}
	}
	if err := r.writeMarker(parentFd, fd, claim, id.String()); err != nil {
		return quota.ID{}, err
	}
	if from != nil && !snapshot {
		if err := from.fill(fd, r.xattr); err != nil {
			return quota.ID{}, err
		}
	}
	return id, nil
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
// a directory is read removalBatch names at a time, never listed whole, since a tenant decides
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
	// batch is how many names are read from a directory at a time; buf holds what one read
	// returns.
	batch int
	buf   []byte
}

// removalBatch is how many names a Removal reads from a directory at a time.
const removalBatch = 1000

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

// dirent is one name read from a directory and the offset of the entry after it.
type dirent struct {
	name string
	off  int64
}

// StartRemoval prepares the removal of rel; nothing is removed until Step. A missing parent of
// rel gives a Removal that is done at once. Close it when done.
func (r *Root) StartRemoval(rel string) (*Removal, error) {
	if _, err := CleanRelPath(rel); err != nil {
		return nil, err
	}
	parent, name := split(rel)
	rm := &Removal{what: rel + " in " + r.path, parentFd: -1, name: name, cur: -1, batch: removalBatch}
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
	if rm.buf == nil {
		rm.buf = make([]byte, 32<<10)
	}
	for {
		if _, err := unix.Seek(fd, top.off, io.SeekStart); err != nil {
			if top.off != 0 && errors.Is(err, unix.EINVAL) {
				// The offset is no longer valid on a new descriptor (overlayfs numbers a
				// merged directory's entries per open, and the directory has shrunk): a
				// pass from the start finds whatever is left.
				top.off, top.seen = 0, false
				continue
			}
			return false, fmt.Errorf("read directory %s: seek: %w", rm.where(""), err)
		}
		n, err := unix.Getdents(fd, rm.buf)
		if err != nil && top.off != 0 && errors.Is(err, unix.EINVAL) {
			// Reading on from the offset is refused (FUSE file systems, the test NFS client
			// among them, know an offset only on the descriptor that returned it).
			top.off, top.seen = 0, false
			continue
		}
		if err != nil {
			return false, fmt.Errorf("read directory %s: %w", rm.where(""), err)
		}
		if n == 0 {
			// seen is false only while a pass that began at the start has found nothing.
			if !top.seen {
				return false, nil
			}
			top.off, top.seen = 0, false
			continue
		}
		top.children = parseDirents(rm.buf[:n], top.children[:0], rm.batch)
		if len(top.children) > 0 {
			top.seen = true
			return true, nil
		}
		// Only "." and "..": carry on past them.
		top.off = lastDirentOff(rm.buf[:n])
	}
}

// parseDirents appends up to max names, "." and ".." left out, from buf as getdents64(2) fills
// it.
func parseDirents(buf []byte, out []dirent, max int) []dirent {
	for len(buf) >= direntNameOff && len(out) < max {
		off := int64(binary.NativeEndian.Uint64(buf[8:16]))
		reclen := int(binary.NativeEndian.Uint16(buf[16:18]))
		if reclen < direntNameOff || reclen > len(buf) {
			break
		}
		name := buf[direntNameOff:reclen]
		if i := bytes.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		if s := string(name); s != "." && s != ".." {
			out = append(out, dirent{name: s, off: off})
		}
		buf = buf[reclen:]
	}
	return out
}

// lastDirentOff is the offset past the last entry in buf as getdents64(2) fills it.
func lastDirentOff(buf []byte) int64 {
	var off int64
	for len(buf) >= direntNameOff {
		reclen := int(binary.NativeEndian.Uint16(buf[16:18]))
		if reclen < direntNameOff || reclen > len(buf) {
			break
		}
		off = int64(binary.NativeEndian.Uint64(buf[8:16]))
		buf = buf[reclen:]
	}
	return off
}

// direntNameOff is where the name starts in a linux_dirent64: after d_ino, d_off, d_reclen
// and d_type.
const direntNameOff = 19

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
	rm := &Removal{what: name, parentFd: fd, name: name, mnt: mnt, cur: -1, batch: removalBatch}
	defer rm.Close()
	for {
		_, done, err := rm.Step(math.MaxInt)
		if err != nil || done {
			return err
		}
	}
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
	if _, err := CleanRelPath(rel); err != nil {
		return err
	}
	parent, name := split(rel)
	parentFd, err := r.openDir(parent, unix.O_PATH)
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

// moveRecord moves the record file of the directory just moved to newName in dirFd from its
// old parent, so the volume stays marked where it went and its removal there removes the
// record too. Best effort: a record left behind names an inode, which only a directory made
// later with the same inode can meet, and that one drops or overwrites it.
func moveRecord(oldParentFd, dirFd int, newName string) {
	var st unix.Stat_t
	if err := unix.Fstatat(dirFd, newName, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return
	}
	rec := recordOf(st.Ino)
	_ = unix.Renameat(oldParentFd, rec, dirFd, rec)
}

// renameat2 is unix.Renameat2; tests replace it to act as the NFS client does.
var renameat2 = unix.Renameat2

// renameNoReplace renames name in parentFd to newName in dirFd, failing with EEXIST if newName
// exists. The volume's marker goes with it when the directory stays in its parent: the
// attribute is on the directory, a record file is named after its inode in the same parent.
func (r *Root) renameNoReplace(parentFd int, name string, dirFd int, newName string) error {
	err := renameat2(parentFd, name, dirFd, newName, unix.RENAME_NOREPLACE)
	if !errors.Is(err, unix.EINVAL) {
		return err
	}
	// NFS (the kernel client, and so the test helper) has no RENAME_NOREPLACE. Claim the name,
	// then rename, one at a time per target in this process; dirpv's NFS volumes are all made
	// by the one leader, so the race left is with a process outside dirpv writing the export.
	// A crash between the two leaves the empty placeholder beside the complete temporary
	// directory; the claim's retry removes the placeholder (dropPlaceholder) and starts again.
	var dir unix.Stat_t
	if err := unix.Fstat(dirFd, &dir); err != nil {
		return fmt.Errorf("stat target directory: %w", err)
	}
	defer renameLocks.MustLock(renameTarget{dirIno: dir.Ino, name: newName})()
	// The check is the server's, not a stat: a mount's cached lookup can still miss a directory
	// that another mount of the export (a class with other mount options, its own superblock
	// and caches) renamed into place an instant ago, and the rename would then replace that
	// empty new volume, handing one directory to two claims (TestSameNameClaimsAcrossMounts,
	// 1 round in many). The server decides a mkdir, and the rename replaces the empty
	// directory it made.
	if err := unix.Mkdirat(dirFd, newName, 0); err != nil {
		return err
	}
	if err := unix.Renameat(parentFd, name, dirFd, newName); err != nil {
		if rerr := unix.Unlinkat(dirFd, newName, unix.AT_REMOVEDIR); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the placeholder %s: %w", newName, rerr))
		}
		return err
	}
	return nil
}

// renameLocks serialises renameNoReplace's check-then-rename per target, for the whole
// process: every NFS call works on its own Root (Dup), and classes that differ in mount options
// reach one export through separate mounts, so a lock per Root or per mount serialises
// nothing, and a rename onto an empty directory replaces it, handing one directory to two
// claims. The key is the target directory's inode number, which NFS takes from the server and
// so is the same through every mount of an export, and the target's name; colliding inode
// numbers of other file systems only serialise more. One lock per target rather than one for
// the process, because a rename on a dead server holds its lock until the server answers,
// which must not stop renames on other exports.
var renameLocks keyed.Locks[renameTarget]

type renameTarget struct {
	dirIno uint64
	name   string
}

// Mkdir makes sure the directory rel exists beneath the root, creating it with mode (umask
// applies) if it is missing. Unlike MkdirAll it creates no parents and marks nothing: it is for
// dirpv's own directories, which are not volumes.
func (r *Root) Mkdir(rel string, mode uint32) error {
	if _, err := CleanRelPath(rel); err != nil {
		return err
	}
	parent, name := split(rel)
	parentFd, err := r.openDir(parent, unix.O_PATH)
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

// Dup returns a second handle on the same base directory, closed independently, so that a
// caller can keep using the base after its owner closed its own handle.
func (r *Root) Dup() (*Root, error) {
	fd, err := unix.FcntlInt(uintptr(r.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate handle on %s: %w", r.path, err)
	}
	return &Root{path: r.path, fd: fd, xattr: r.xattr}, nil
}
