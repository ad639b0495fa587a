package volume

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume/quota"
)

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
	if err := r.dropOwnPlaceholder(parentFd, name, tmp, claim); err != nil {
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

// dropOwnPlaceholder removes the placeholder (dropPlaceholder) a crash inside
// renameNoReplace left at name, if claim's own marked temporary directory tmp is beside it, so
// that adopt, which refuses a directory that is no volume, judges what is really there.
func (r *Root) dropOwnPlaceholder(parentFd int, name, tmp string, claim Claim) error {
	if !r.isPlaceholder(parentFd, name) {
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
	return r.dropPlaceholder(parentFd, name)
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
	if snapshot {
		if err := from.dropDevices(fd); err != nil {
			return quota.ID{}, err
		}
	}
	return id, nil
}

// VolumeOwner returns the claim the marker of the volume directory rel names. marked is false
// if rel carries no marker; owner is empty if the marker names no claim (a volume made before
// dirpv recorded owners). It fails with an error wrapping os.ErrNotExist if rel does not exist.
func (r *Root) VolumeOwner(rel string) (owner Claim, marked bool, err error) {
	parentFd, name, err := r.parentOf(rel)
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
