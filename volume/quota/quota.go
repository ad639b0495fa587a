// Package quota sets, reads and clears the capacity limit of one volume directory, with what
// the file system under a base path can enforce: XFS and ext4 project quotas, or a btrfs
// subvolume with a qgroup limit. Usage is always read from the quota itself, never by walking
// the tree, so it is cheap enough for every NodeGetVolumeStats call.
package quota

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Kind is the enforcement mechanism of a file system.
type Kind string

const (
	// Project is an XFS or ext4 project quota: the volume directory carries a project ID that
	// its files inherit, and the project has a hard block limit.
	Project Kind = "project"
	// Btrfs is a btrfs subvolume whose level-0 qgroup has a referenced-bytes limit.
	Btrfs Kind = "btrfs"
)

// ID names one volume's quota: the project ID or the btrfs subvolume ID. Its String form is
// what the volume marker and the PV attributes store.
type ID struct {
	Kind Kind
	Num  uint64
}

// String renders the ID as "<kind>/<number>", the form ParseID reads.
func (id ID) String() string {
	if id.Kind == "" {
		return ""
	}
	return string(id.Kind) + "/" + strconv.FormatUint(id.Num, 10)
}

// ParseID reads an ID written by String.
func ParseID(s string) (ID, error) {
	k, n, ok := strings.Cut(s, "/")
	num, err := strconv.ParseUint(n, 10, 64)
	if !ok || err != nil || num == 0 {
		return ID{}, fmt.Errorf("quota ID %q: want project/<n> or btrfs/<n>", s)
	}
	switch id := (ID{Kind: Kind(k), Num: num}); id.Kind {
	case Project:
		if num > maxProjectID {
			return ID{}, fmt.Errorf("quota ID %q: project IDs are 32-bit", s)
		}
		return id, nil
	case Btrfs:
		return id, nil
	}
	return ID{}, fmt.Errorf("quota ID %q: unknown kind %q", s, k)
}

// Usage is what a volume holds and may hold, from its quota.
type Usage struct {
	// UsedBytes is the space charged to the volume; LimitBytes its hard limit (0: none).
	UsedBytes, LimitBytes uint64
	// HasInodes says whether the inode figures are known (project quotas count inodes, btrfs
	// qgroups do not). LimitInodes is 0 where there is no inode limit.
	HasInodes               bool
	UsedInodes, LimitInodes uint64
}

// ErrNotEnforceable wraps every reason a file system cannot enforce limits.
var ErrNotEnforceable = errors.New("cannot enforce volume sizes")

// FS is the file system under one base directory, as far as limits go. Its methods take
// descriptors of directories on that file system, opened by the caller without following
// symlinks; they never resolve paths themselves.
type FS struct {
	kind Kind
	// unit is the file system's block size: limits are rounded up to it.
	unit uint64
	// reason says why limits cannot be enforced (kind is empty then).
	reason error
}

// projectMu makes choosing a project ID and setting it on its directory one step against every
// other allocation and Release in this process. It is one lock for the process, not one per FS:
// each base path gets its own FS, and several bases can share a file system and so its project
// IDs. Across processes and restarts the ID is checked unused on disk.
var projectMu sync.Mutex

// Probe opens nothing: it inspects the file system holding the directory open at fd (any
// flags but O_PATH for btrfs) and reports what it can enforce. A file system that cannot
// enforce is not an error: Enforces then says why.
func Probe(fd int) (*FS, error) {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return nil, fmt.Errorf("statfs: %w", err)
	}
	f := &FS{unit: max(uint64(sfs.Bsize), 1024)}
	switch uint32(sfs.Type) {
	case unix.XFS_SUPER_MAGIC, unix.EXT4_SUPER_MAGIC:
		name := "xfs"
		if uint32(sfs.Type) == unix.EXT4_SUPER_MAGIC {
			name = "ext4"
		}
		if err := probeProject(fd); err != nil {
			f.reason = fmt.Errorf("%w: %s project quota is off (%v): mount the file system with -o prjquota (ext4 also needs mkfs.ext4 -O quota,project or tune2fs -O project,quota)", ErrNotEnforceable, name, err)
		} else {
			f.kind = Project
		}
	case unix.BTRFS_SUPER_MAGIC:
		if err := probeBtrfs(fd); err != nil {
			f.reason = fmt.Errorf("%w: btrfs quota is off (%v): run btrfs quota enable on the file system", ErrNotEnforceable, err)
		} else {
			f.kind = Btrfs
		}
	default:
		f.reason = fmt.Errorf("%w: file system type %#x has no per-directory quota dirpv can use; put the base path on XFS or ext4 mounted with -o prjquota, or on btrfs with quota enabled", ErrNotEnforceable, sfs.Type)
	}
	return f, nil
}

// Enforces returns nil if limits can be set here, or an error wrapping ErrNotEnforceable that
// says why not and how to fix it.
func (f *FS) Enforces() error {
	if f.kind == "" {
		return f.reason
	}
	return nil
}

// Kind is the mechanism limits use here, empty if none.
func (f *FS) Kind() Kind { return f.kind }

// Round is bytes rounded up to the file system's unit, the limit SetLimit sets.
func (f *FS) Round(bytes uint64) uint64 {
	return (bytes + f.unit - 1) / f.unit * f.unit
}

// Mkdir makes the directory name in parentFd with mode perm (before umask) as something a
// limit can be set on: a subvolume on btrfs, a plain directory elsewhere.
func (f *FS) Mkdir(parentFd int, name string, perm uint32) error {
	if f.kind == Btrfs {
		if err := CreateSubvolume(parentFd, name); err != nil {
			return fmt.Errorf("create btrfs subvolume %s: %w", name, err)
		}
		// A subvolume is created 0755 whatever the umask; the caller sets the exact mode.
		return nil
	}
	if err := unix.Mkdirat(parentFd, name, perm); err != nil {
		return fmt.Errorf("mkdir %s: %w", name, err)
	}
	return nil
}

// SetLimit gives the empty directory open at fd (read-only, not O_PATH) a hard limit of
// bytes, rounded up with Round, and returns the ID that names it. The directory must have
// been made by Mkdir.
func (f *FS) SetLimit(fd int, bytes uint64) (ID, error) {
	switch f.kind {
	case Project:
		return f.setProject(fd, f.Round(bytes))
	case Btrfs:
		sub, err := btrfsSubvolID(fd)
		if err != nil {
			return ID{}, err
		}
		if err := btrfsLimit(fd, sub, f.Round(bytes)); err != nil {
			return ID{}, err
		}
		return ID{Kind: Btrfs, Num: sub}, nil
	}
	return ID{}, f.reason
}

// Unlimit clears the limit of id, which must name the limit of the volume directory open at
// fd (read-only, not O_PATH), before that volume is removed: while the directory is in place
// and carries id, the ID is provably the volume's, and once it is gone its project is free as
// soon as its files are no longer charged, however late that is. A directory that does not
// carry id is left as it is (Release after the removal still applies). On btrfs the limit is
// lifted too, although it goes with its subvolume: at its limit, a subvolume's tree cannot be
// removed, since deleting a subvolume nested in it (which any tenant may make) charges its
// qgroup and fails with EDQUOT.
func (f *FS) Unlimit(fd int, id ID) error {
	if id.Kind != f.kind {
		return fmt.Errorf("quota %s is not of this file system (%s)", id, f.describe())
	}
	if id.Kind == Project {
		return unlimitProject(fd, uint32(id.Num))
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("stat: %w", err)
	}
	if st.Ino != btrfsFirstFreeObject {
		return nil
	}
	sub, err := btrfsSubvolID(fd)
	if err != nil || sub != id.Num {
		return err
	}
	// Through the parent directory, in another subvolume: the ioctl's transaction is charged
	// to the subvolume of the file it is made on, and through the volume itself it fails
	// with EDQUOT once the volume holds more than its limit (a snapshot clone that did not fit).
	parent, err := unix.Openat(fd, "..", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the parent directory: %w", err)
	}
	defer unix.Close(parent)
	return btrfsLimit(parent, sub, 0)
}

// IDOf returns the ID of the limit that the directory open at fd (read-only, not O_PATH),
// made by Mkdir in the directory open at parentFd, was given, for a directory that may have
// none yet and has no marker to say (a crash between Mkdir and its marker). ok is false if it
// has none of its own: no project ID but the one it inherited from its parent, or, on btrfs,
// not a subvolume.
func (f *FS) IDOf(parentFd, fd int) (id ID, ok bool, err error) {
	switch f.kind {
	case Project:
		own, err := projectOf(fd)
		if err != nil {
			return ID{}, false, err
		}
		inherited, err := projectOf(parentFd)
		if err != nil {
			return ID{}, false, err
		}
		if own == 0 || own == inherited {
			return ID{}, false, nil
		}
		return ID{Kind: Project, Num: uint64(own)}, true, nil
	case Btrfs:
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return ID{}, false, fmt.Errorf("stat: %w", err)
		}
		if st.Ino != btrfsFirstFreeObject {
			return ID{}, false, nil
		}
		sub, err := btrfsSubvolID(fd)
		if err != nil {
			return ID{}, false, err
		}
		return ID{Kind: Btrfs, Num: sub}, true, nil
	}
	return ID{}, false, nil
}

// Usage reads the usage and limit of id, through any directory on the file system open at fd.
func (f *FS) Usage(fd int, id ID) (Usage, error) {
	if id.Kind != f.kind {
		return Usage{}, fmt.Errorf("quota %s is not of this file system (%s)", id, f.describe())
	}
	if id.Kind == Project {
		return projectUsage(fd, uint32(id.Num))
	}
	return btrfsUsage(fd, id.Num)
}

// Release clears the limit of id once its volume is gone, through any directory on the file
// system open at fd, so the ID can be used again. A released or unknown ID is not an error.
// A project that files are still charged to is left alone: its volume's inode, and so its ID,
// may already be a new volume's (a retried Delete). id must be the one the volume's marker
// recorded: any limit of a project with no files is cleared. Removed files can stay charged a
// while (XFS frees removed inodes in the background): a volume still in place is given Unlimit
// before its removal, so that its project has no limit left by then.
func (f *FS) Release(fd int, id ID) error {
	if id.Kind != f.kind {
		return fmt.Errorf("quota %s is not of this file system (%s)", id, f.describe())
	}
	if id.Kind == Project {
		return releaseProject(fd, uint32(id.Num))
	}
	return btrfsDestroyQgroup(fd, id.Num)
}

func (f *FS) describe() string {
	if f.kind == "" {
		return "no quota"
	}
	return string(f.kind)
}

// Resize sets the hard limit of id, the quota of the volume directory open at fd (read-only,
// not O_PATH), to bytes rounded up with Round. It refuses an id the directory does not carry,
// so a limit is only ever moved on the volume it was asked for. Only the block limit changes:
// what the volume holds stays charged to it.
func (f *FS) Resize(fd int, id ID, bytes uint64) error {
	if id.Kind != f.kind {
		return fmt.Errorf("quota %s is not of this file system (%s)", id, f.describe())
	}
	if bytes == 0 {
		return fmt.Errorf("resize quota %s: a limit of 0 bytes", id)
	}
	limit := f.Round(bytes)
	if id.Kind == Project {
		got, err := projectOf(fd)
		if err != nil {
			return err
		}
		if uint64(got) != id.Num {
			return fmt.Errorf("resize quota %s: the directory is in project %d", id, got)
		}
		projectMu.Lock()
		defer projectMu.Unlock()
		return setProjectLimit(fd, got, limit)
	}
	sub, err := btrfsSubvolID(fd)
	if err != nil {
		return err
	}
	if sub != id.Num {
		return fmt.Errorf("resize quota %s: the directory is subvolume %d", id, sub)
	}
	return btrfsLimit(fd, sub, limit)
}
