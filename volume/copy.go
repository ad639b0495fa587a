package volume

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume/quota"
)

// Source names a tree to copy a new volume from: a volume directory beneath Root, or a
// snapshot (Root.SnapshotSource).
type Source struct {
	Root *Root
	Rel  string
}

// How a copy was made (CopyStats.Method).
const (
	// MethodBtrfsSnapshot: the new volume is a btrfs snapshot of the source subvolume; nothing
	// was walked.
	MethodBtrfsSnapshot = "btrfs-snapshot"
	// MethodReflink: every regular file was cloned (FICLONE), sharing its extents.
	MethodReflink = "reflink"
	// MethodCopy: every regular file's data was copied (copy_file_range, or read and write).
	MethodCopy = "copy"
	// MethodMixed: some files were cloned and some copied.
	MethodMixed = "mixed"
)

// CopyStats says what a copy made. With MethodBtrfsSnapshot nothing is walked and the counts
// are 0.
type CopyStats struct {
	// Dirs, Files, Symlinks count what was made below the volume's root; HardLinks the extra
	// names of files already copied, made as links to the copy; Special the FIFOs and sockets
	// made again (mknod; a socket is only a name, nothing listens on it in the copy).
	Dirs, Files, Symlinks, HardLinks, Special int64
	// Bytes is the apparent size of the regular files copied, each inode once.
	Bytes int64
	// Allocated is the space the source's files and directories occupied (st_blocks), each
	// inode once: what a limit on the copy must hold.
	Allocated int64
	// SkippedDevices counts character and block device nodes left out, Vanished the entries
	// that went, or changed kind, while the copy ran, XattrsSkipped the extended attributes the
	// target's file system does not support.
	SkippedDevices, Vanished, XattrsSkipped int64
	// LinksNotKept counts the names of files with several names that found the copy's
	// hard-link table full (linkTableBytes): each was copied as a file of its own, not
	// linked to the file's other names.
	LinksNotKept int64
	// Method is how the files' data was copied: one of the Method constants.
	Method string
}

// ErrMountInSource is returned when the source of a copy has a mount point inside it: a
// copy never crosses one, as RemoveAll never does, and a copy without what is mounted there
// would be silently incomplete.
var ErrMountInSource = errors.New("is a mount point inside the source; a copy never crosses a mount")

// ErrSourceMoved is returned when a directory of the source was moved elsewhere while it was
// being copied; the copy stops rather than follow it. Trying again copies what is there then.
var ErrSourceMoved = errors.New("was moved while it was being copied")

// MkdirAllFrom is MkdirAllLimited (limit 0: MkdirAll, no limit) for a volume that starts as a
// copy of src's tree. The copy is made inside the volume's temporary directory, after its
// limit is set and before it is renamed into place, so a claim never gets a half copy; what a
// crash leaves there is removed by the next attempt, which copies again. The volume's root
// takes the source root's mode, owner, extended attributes and times, as cp -a would. A
// volume that exists for claim is adopted as MkdirAll does, with nothing copied.
//
// What the copy keeps: directories, regular files (holes kept: only data extents are copied),
// symlinks (copied, never followed), hard links (as links within the copy), FIFOs and
// sockets (made again), modes (setuid, setgid and sticky included), owners, access and
// modification times, and extended attributes of every namespace (trusted.* and security.*
// too: dirpv runs as root; ACLs are their system.posix_acl_* attributes) except dirpv's own
// volume marker. An attribute the target's file system does not support (ENOTSUP) is left
// out and counted, as a copy to NFS must. Device nodes are left out and counted: one written
// by a pod into its volume would otherwise become, in a clone, a device node that no one
// reviewed, readable by whoever can read the clone on the host.
//
// The walk never follows a symlink, never leaves either tree (every lookup is openat2 beneath
// the directory it starts from, without symlinks; going back up checks the directory is the
// one it left) and never crosses a mount (ErrMountInSource). Regular files with a single name
// are copied a few at a time (copyWorkers), so that the round trips of each to an NFS server
// overlap; a directory's times are set once all its entries are made. It holds a constant
// number of descriptors whatever the tree's size or depth, and memory that does not grow with
// the tree's size: it reads dirBatch names of a directory at a time (a level's batch is dropped
// when it descends, and read on from where it stopped when it comes back), and its hard-link
// table holds at most linkTableBytes (LinksNotKept); what grows with depth is one small record
// per level, as in RemoveAll. The source may be written meanwhile: an entry that goes or
// changes kind before it is copied is left out (Vanished); a name made in a directory behind
// where the walk has read may be left out too; a file written meanwhile is copied as it is read; a directory moved away
// while its children are copied stops the copy (ErrSourceMoved). ctx is checked between
// entries and between chunks of a file.
//
// Where the base is btrfs, the target limited and the source a subvolume of the same file
// system (a limited volume, or a snapshot of one) holding no nested subvolume (which a
// snapshot would leave empty, so such a source is walked), the new volume is a snapshot of it
// (MethodBtrfsSnapshot) given its own qgroup limit, which fails if the source already uses
// more. Its device nodes are then removed, as a copy leaves them out: that walk reads every
// directory of the snapshot but stats only the names their directory says may be devices
// (or does not say). Elsewhere each file is cloned (FICLONE) where
// the file system can, copied otherwise. A copy that does not fit the limit fails with an
// error wrapping unix.EDQUOT or ENOSPC.
//
// It works on handles of its own: r and src.Root may be closed once it has started.
func (r *Root) MkdirAllFrom(ctx context.Context, rel string, claim Claim, limit uint64, src Source) (created bool, id quota.ID, stats CopyStats, err error) {
	if src.Root == nil {
		return false, quota.ID{}, stats, fmt.Errorf("volume %s: no source to copy from", rel)
	}
	if r, src.Root, err = dupRoots(r, src.Root); err != nil {
		return false, quota.ID{}, stats, err
	}
	defer r.Close()
	defer src.Root.Close()
	if limit > 0 {
		fs, err := r.Quota()
		if err != nil {
			return false, quota.ID{}, stats, err
		}
		if err := fs.Enforces(); err != nil {
			return false, quota.ID{}, stats, fmt.Errorf("base %s: %w", r.path, err)
		}
	}
	from := &copyFrom{ctx: ctx, src: src, fd: -1, stats: &stats}
	defer from.close()
	// The owner is the source root's, read once the source is opened (makeMarked).
	created, id, err = r.mkdirAll(rel, Owner{}, claim, limit, from)
	if err == nil && created {
		klog.FromContext(ctx).V(2).Info("Volume copied", "path", rel, "base", r.path,
			"source", src.Rel, "sourceBase", src.Root.path, "stats", stats)
	}
	return created, id, stats, err
}

// dupRoots returns handles of their own on target and source, for a copy: one can outlast
// the wait for it at shutdown (nothing interrupts a clone of a huge file), after which its
// caller closes its roots, and a descriptor number closed under the copy can be handed to
// another file before the copy uses it.
func dupRoots(target, source *Root) (*Root, *Root, error) {
	t, err := target.Dup()
	if err != nil {
		return nil, nil, err
	}
	s, err := source.Dup()
	if err != nil {
		t.Close()
		return nil, nil, err
	}
	return t, s, nil
}

// copyFrom is what createVolume needs to fill a new volume from a source.
type copyFrom struct {
	ctx context.Context
	src Source
	// fd is the source's root directory, -1 until open; owner is its mode and owner.
	fd    int
	owner Owner
	stats *CopyStats
}

// open opens the source, once a volume is to be made: an adopted one needs no source, which
// may be gone by the time a retry adopts it.
func (f *copyFrom) open() error {
	fd, err := openSourceDir(f.src.Root, f.src.Rel)
	if err != nil {
		return fmt.Errorf("copy source: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return fmt.Errorf("stat copy source %s in %s: %w", f.src.Rel, f.src.Root.path, err)
	}
	f.fd, f.owner = fd, Owner{Mode: st.Mode & 0o7777, UID: int(st.Uid), GID: int(st.Gid)}
	return nil
}

func (f *copyFrom) close() {
	if f.fd >= 0 {
		unix.Close(f.fd)
		f.fd = -1
	}
}

// snapshot makes name in parentFd a btrfs snapshot of the source, if there is one and it is a
// subvolume of fs, btrfs with quota on; it reports false, having made nothing, if not.
func (f *copyFrom) snapshot(fs *quota.FS, parentFd int, name string) (bool, error) {
	if f == nil || fs.Kind() != quota.Btrfs {
		return false, nil
	}
	err := quota.Snapshot(f.fd, parentFd, name, false)
	if errors.Is(err, quota.ErrNoSnapshot) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("snapshot %s in %s: %w", f.src.Rel, f.src.Root.path, err)
	}
	f.stats.Method = MethodBtrfsSnapshot
	return true, nil
}

// dropDevices removes from the btrfs snapshot open at fd the device nodes a copy would have
// left out: a clone made the fast way keeps MkdirAllFrom's promise too.
func (f *copyFrom) dropDevices(fd int) error {
	n, err := dropDeviceNodes(f.ctx, fd)
	f.stats.SkippedDevices += n
	if err != nil {
		return fmt.Errorf("leave device nodes out of the snapshot of %s: %w", f.src.Rel, err)
	}
	if n > 0 {
		klog.FromContext(f.ctx).Info("Device nodes left out of a copy", "count", n, "source", f.src.Rel)
	}
	return nil
}

// checkFits fails, wrapping EDQUOT, if the volume open at fd, limited by id, already holds
// more than its limit: a snapshot of a source bigger than the new volume may hold.
func checkFits(fs *quota.FS, fd int, id quota.ID) error {
	u, err := fs.Usage(fd, id)
	if err != nil {
		return fmt.Errorf("read the snapshot's usage: %w", err)
	}
	if u.LimitBytes > 0 && u.UsedBytes > u.LimitBytes {
		return fmt.Errorf("the source holds %d bytes, more than the new volume's limit of %d: %w", u.UsedBytes, u.LimitBytes, unix.EDQUOT)
	}
	return nil
}

// openSourceDir opens the directory rel of root as a copy source: read-only, and without
// updating its access time where the kernel lets dirpv (it does for root).
func openSourceDir(root *Root, rel string) (int, error) {
	fd, err := root.openDir(rel, unix.O_RDONLY|unix.O_NOATIME)
	if errors.Is(err, unix.EPERM) {
		fd, err = root.openDir(rel, unix.O_RDONLY)
	}
	return fd, err
}

// fill copies the source's tree into the new volume's directory open at fd, whose mode and
// owner are already the source root's.
func (f *copyFrom) fill(fd int, skipXattr string) error {
	c, err := newCopier(f.ctx, f.stats, f.fd, fd, skipXattr)
	if err != nil {
		return err
	}
	defer c.close()
	failpoint.Reach(failpoint.CopyStarted)
	if err := c.copyTree(); err != nil {
		return err
	}
	f.stats.Method = c.method()
	return nil
}
