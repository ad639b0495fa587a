package volume

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume/quota"
)

// Snapshots are kept in snapshotsDir at the base, beside the volumes, under a reserved name no
// pathPattern can produce. Each is a directory named after the snapshot holding the copy
// (snapshotTree) and what SnapshotInfo returns (snapshotInfoFile). It is made under a
// temporary name and renamed into place once complete, and renamed away before it is removed,
// so a snapshot in place under its name is always complete.
const (
	snapshotsDir     = ReservedPrefix + "snapshots"
	snapshotTree     = "tree"
	snapshotInfoFile = "info.json"
	// snapshotGonePrefix names snapshots being deleted.
	snapshotGonePrefix = ReservedPrefix + "del-"
	maxSnapshotName    = 200
)

// SnapshotOptions are how a snapshot is made.
type SnapshotOptions struct {
	// Margin is the free space, in bytes, a copy must leave on the base (CheckRoomForCopy).
	Margin uint64
	// Limit, if not 0, is the most a copy may hold, in bytes, where the base enforces limits
	// (a project quota, a btrfs qgroup): the source's size, so that a snapshot takes no more
	// of the base than its source may. A btrfs snapshot needs none: it is read-only.
	Limit uint64
	// KeepFailed leaves what a failed copy made under its temporary name, for the next
	// attempt or MoveSnapshot to take away, instead of removing it at once: on NFS a copy
	// that was stopped gets only the operation timeout to return before its server counts as
	// dead, and a big half-made tree takes longer to remove.
	KeepFailed bool
}

// SnapshotInfo describes a snapshot.
type SnapshotInfo struct {
	Name string `json:"name"`
	// Source is the volume it was taken of.
	Source string `json:"source"`
	// Size is the space the snapshot's tree uses, in bytes: its qgroup's referenced bytes for
	// a btrfs snapshot (0 where quota is off), the space its source's files occupied for a
	// copy. A volume restored from it needs at least that much.
	Size      uint64    `json:"size"`
	CreatedAt time.Time `json:"createdAt"`
	// Method is how it was made: MethodBtrfsSnapshot, or how a copy was (CopyStats.Method).
	Method string `json:"method"`
}

// Snapshot makes a point-in-time copy named name of the volume rel, kept beside the volumes
// at the base (see SnapshotSource). Where the volume is a btrfs subvolume holding no nested
// subvolume (a snapshot would leave it empty), the copy is a read-only btrfs snapshot: atomic,
// and read-only to everyone. Elsewhere it is a copy made as
// MkdirAllFrom makes one, entry by entry while the volume may be written, so it is only
// point-in-time for a volume no one writes meanwhile; it is read-only in that dirpv never
// writes it and never mounts it anywhere, nothing more.
//
// It is idempotent: a complete snapshot named name is returned as it is, and one of another
// volume is refused. It is made under a temporary name and renamed once complete; what a
// crash leaves is removed by the next attempt. name is one path component not starting with
// ReservedPrefix. It works on a handle of its own: r may be closed once it has started.
//
// A copy is started only if the base has room for it (CheckRoomForCopy with opts.Margin):
// one that cannot complete would fill the base for every volume on it.
func (r *Root) Snapshot(ctx context.Context, rel, name string, opts SnapshotOptions) (SnapshotInfo, error) {
	if err := checkSnapshotName(name); err != nil {
		return SnapshotInfo{}, err
	}
	if _, err := CleanRelPath(rel); err != nil {
		return SnapshotInfo{}, err
	}
	if err := checkReserved(rel); err != nil {
		return SnapshotInfo{}, err
	}
	// A handle of its own, as MkdirAllFrom's (dupRoots).
	r, err := r.Dup()
	if err != nil {
		return SnapshotInfo{}, err
	}
	defer r.Close()
	if err := r.Mkdir(snapshotsDir, 0o700); err != nil {
		return SnapshotInfo{}, err
	}
	dirFd, err := r.openDir(snapshotsDir, unix.O_RDONLY)
	if err != nil {
		return SnapshotInfo{}, err
	}
	defer unix.Close(dirFd)
	if info, err := r.existingSnapshot(dirFd, name, rel); !errors.Is(err, os.ErrNotExist) {
		return info, err
	}
	mnt, err := mountID(dirFd)
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("%s in %s: %w", snapshotsDir, r.path, err)
	}
	tmp := snapshotTemp(name)
	// A crash after the copy was complete (on NFS, inside the rename into place) left it whole
	// under tmp, its info written last: it is renamed into place, not copied again.
	info, err := r.readSnapshotInfo(dirFd, tmp)
	if err != nil || info.Name != name || info.Source != rel {
		info, err = r.copySnapshot(ctx, dirFd, tmp, mnt, rel, name, opts)
	}
	if err == nil {
		err = r.renameNoReplace(dirFd, tmp, dirFd, name)
		if errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY) {
			// Another worker made it meanwhile.
			if rerr := r.removeSnapshotAt(dirFd, tmp, mnt); rerr != nil {
				return SnapshotInfo{}, fmt.Errorf("remove the unused snapshot %s: %w", tmp, rerr)
			}
			return r.existingSnapshot(dirFd, name, rel)
		}
	}
	if err != nil {
		err = fmt.Errorf("snapshot %s of %s in %s: %w", name, rel, r.path, err)
		if opts.KeepFailed {
			return SnapshotInfo{}, err
		}
		if rerr := r.removeSnapshotAt(dirFd, tmp, mnt); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the half-made snapshot: %w", rerr))
		}
		return SnapshotInfo{}, err
	}
	klog.FromContext(ctx).V(2).Info("Snapshot made", "snapshot", name, "volume", rel, "base", r.path, "method", info.Method, "size", info.Size)
	return info, nil
}

// copySnapshot makes the snapshot name of the volume rel as tmp in dirFd, in place of what an
// earlier attempt left there.
func (r *Root) copySnapshot(ctx context.Context, dirFd int, tmp string, mnt uint64, rel, name string, opts SnapshotOptions) (SnapshotInfo, error) {
	srcFd, err := openSourceDir(r, rel)
	if err != nil {
		return SnapshotInfo{}, err
	}
	defer unix.Close(srcFd)
	// What an earlier attempt left goes first: the check counts the space it held as free.
	if err := r.removeSnapshotAt(dirFd, tmp, mnt); err != nil {
		return SnapshotInfo{}, fmt.Errorf("remove what an earlier attempt left: %w", err)
	}
	if err := r.CheckRoomForCopy(ctx, Source{Root: r, Rel: rel}, opts.Margin); err != nil {
		return SnapshotInfo{}, err
	}
	return r.makeSnapshot(ctx, dirFd, tmp, srcFd, rel, name, opts.Limit)
}

// makeSnapshot makes the snapshot name of the volume rel, open at srcFd, as tmp in dirFd.
func (r *Root) makeSnapshot(ctx context.Context, dirFd int, tmp string, srcFd int, rel, name string, limit uint64) (SnapshotInfo, error) {
	info := SnapshotInfo{Name: name, Source: rel, CreatedAt: time.Now().UTC().Truncate(time.Second)}
	if err := unix.Mkdirat(dirFd, tmp, 0o700); err != nil {
		return info, fmt.Errorf("mkdir %s: %w", tmp, err)
	}
	tfd, err := r.openChild(dirFd, tmp, tmp)
	if err != nil {
		return info, err
	}
	defer unix.Close(tfd)
	switch err := quota.Snapshot(srcFd, tfd, snapshotTree, true); {
	case err == nil:
		info.Method = MethodBtrfsSnapshot
		info.Size, err = r.snapshotSize(tfd)
		if err != nil {
			return info, err
		}
	case errors.Is(err, quota.ErrNoSnapshot):
		var stats CopyStats
		if err := r.copyInto(ctx, srcFd, tfd, snapshotTree, limit, &stats); err != nil {
			return info, err
		}
		info.Method, info.Size = stats.Method, uint64(stats.Allocated)
	default:
		return info, err
	}
	b, _ := json.Marshal(info) // strings, numbers and a time: cannot fail
	if err := writeFileAt(tfd, snapshotInfoFile, b); err != nil {
		return info, err
	}
	return info, nil
}

// copyInto makes name in parentFd a copy of the tree open at srcFd, its root with the source
// root's mode and owner, held under a limit of limit bytes where the base enforces limits (0:
// none). The limit is found again by removeSnapshotAt, from the directory, not a record.
func (r *Root) copyInto(ctx context.Context, srcFd, parentFd int, name string, limit uint64, stats *CopyStats) error {
	var st unix.Stat_t
	if err := unix.Fstat(srcFd, &st); err != nil {
		return fmt.Errorf("stat the source: %w", err)
	}
	var fs *quota.FS
	if limit > 0 {
		var err error
		if fs, err = r.Quota(); err != nil {
			return err
		}
		if fs.Enforces() != nil {
			fs = nil
		}
	}
	if fs != nil {
		if err := fs.Mkdir(parentFd, name, 0o700); err != nil {
			return err
		}
	} else if err := unix.Mkdirat(parentFd, name, 0o700); err != nil {
		return fmt.Errorf("mkdir %s: %w", name, err)
	}
	fd, err := openBeneath(parentFd, name, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return fmt.Errorf("open %s: %w", name, err)
	}
	defer unix.Close(fd)
	if err := setOwnerMode(fd, &st); err != nil {
		return err
	}
	var id quota.ID
	if fs != nil {
		if id, err = fs.SetLimit(fd, limit); err != nil {
			return fmt.Errorf("set size limit: %w", err)
		}
	}
	err = (&copyFrom{ctx: ctx, fd: srcFd, stats: stats}).fill(fd, r.xattr)
	if err == nil && fs != nil {
		// Reflinked data is charged without being held back by the limit; the charge shows
		// once the file system has committed it (btrfs accounts at commit).
		if err = unix.Syncfs(fd); err != nil {
			err = fmt.Errorf("sync the snapshot: %w", err)
		} else {
			err = checkFits(fs, fd, id)
		}
	}
	if fs != nil && (errors.Is(err, unix.EDQUOT) || errors.Is(err, unix.ENOSPC)) {
		err = fmt.Errorf("the source holds more than its size, %d bytes, the snapshot's limit: %w", limit, err)
	}
	return err
}

// snapshotSize is the referenced bytes of the btrfs snapshot snapshotTree in dirFd, 0 where
// quota is off.
func (r *Root) snapshotSize(dirFd int) (uint64, error) {
	fs, err := r.Quota()
	if err != nil {
		return 0, err
	}
	if fs.Kind() != quota.Btrfs {
		return 0, nil // quota is off: the size is not known
	}
	fd, err := openBeneath(dirFd, snapshotTree, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return 0, fmt.Errorf("open the snapshot: %w", err)
	}
	defer unix.Close(fd)
	id, ok, err := fs.IDOf(dirFd, fd)
	if err != nil || !ok {
		return 0, err
	}
	u, err := fs.Usage(fd, id)
	if err != nil {
		return 0, fmt.Errorf("read the snapshot's usage: %w", err)
	}
	return u.UsedBytes, nil
}

// existingSnapshot returns the snapshot name in dirFd if it is complete and of rel, an
// error wrapping os.ErrNotExist if there is none.
func (r *Root) existingSnapshot(dirFd int, name, rel string) (SnapshotInfo, error) {
	info, err := r.readSnapshotInfo(dirFd, name)
	if err != nil {
		return SnapshotInfo{}, err
	}
	if info.Source != rel {
		return SnapshotInfo{}, fmt.Errorf("snapshot %s in %s exists and is of %s, not %s", name, r.path, info.Source, rel)
	}
	return info, nil
}

func (r *Root) readSnapshotInfo(dirFd int, name string) (SnapshotInfo, error) {
	fd, err := openBeneath(dirFd, name+"/"+snapshotInfoFile, unix.O_RDONLY)
	if errors.Is(err, unix.ENOENT) {
		return SnapshotInfo{}, fmt.Errorf("snapshot %s in %s: %w", name, r.path, os.ErrNotExist)
	}
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("snapshot %s in %s: %w", name, r.path, err)
	}
	f := os.NewFile(uintptr(fd), snapshotInfoFile)
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxMarker))
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("read snapshot %s in %s: %w", name, r.path, err)
	}
	var info SnapshotInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return SnapshotInfo{}, fmt.Errorf("snapshot %s in %s: %s: %w", name, r.path, snapshotInfoFile, err)
	}
	return info, nil
}

// SnapshotInfo describes the snapshot name; it fails with an error wrapping os.ErrNotExist
// if there is none.
func (r *Root) SnapshotInfo(name string) (SnapshotInfo, error) {
	if err := checkSnapshotName(name); err != nil {
		return SnapshotInfo{}, err
	}
	dirFd, err := r.openDir(snapshotsDir, unix.O_PATH)
	if errors.Is(err, unix.ENOENT) {
		return SnapshotInfo{}, fmt.Errorf("snapshot %s in %s: %w", name, r.path, os.ErrNotExist)
	}
	if err != nil {
		return SnapshotInfo{}, err
	}
	defer unix.Close(dirFd)
	return r.readSnapshotInfo(dirFd, name)
}

// DeleteSnapshot removes the snapshot name; a missing one is not an error. The snapshot is
// first renamed away, so that a crash while it is removed never leaves a half snapshot under
// its name; the next DeleteSnapshot of the name finishes the removal.
func (r *Root) DeleteSnapshot(name string) error {
	if err := checkSnapshotName(name); err != nil {
		return err
	}
	dirFd, err := r.openDir(snapshotsDir, unix.O_RDONLY)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(dirFd)
	mnt, err := mountID(dirFd)
	if err != nil {
		return fmt.Errorf("%s in %s: %w", snapshotsDir, r.path, err)
	}
	gone := snapshotGonePrefix + nameHash(name)
	if err := r.removeSnapshotAt(dirFd, gone, mnt); err != nil {
		return fmt.Errorf("delete snapshot %s in %s: %w", name, r.path, err)
	}
	if err := r.renameNoReplace(dirFd, name, dirFd, gone); errors.Is(err, unix.ENOENT) {
		return nil
	} else if err != nil {
		return fmt.Errorf("delete snapshot %s in %s: rename it away: %w", name, r.path, err)
	}
	if err := r.removeSnapshotAt(dirFd, gone, mnt); err != nil {
		return fmt.Errorf("delete snapshot %s in %s: %w", name, r.path, err)
	}
	return nil
}

// MoveSnapshot moves the snapshot name into the directory dir (made if missing), for a
// removal there that may take longer than one call should: an NFS export's trash. It takes the
// few calls a rename does whatever the snapshot's size. What a DeleteSnapshot cut short left
// under its private name goes too, and so does a copy left unfinished (KeepFailed). Each gets
// the same entry in dir on every attempt, so a retry after the move finds it there: it returns
// the entries in dir ("" if neither the snapshot nor its entry exists) and whether this call
// moved anything.
func (r *Root) MoveSnapshot(name, dir string) (entries []string, moved bool, err error) {
	if err := checkSnapshotName(name); err != nil {
		return nil, false, err
	}
	if _, err := CleanRelPath(dir); err != nil {
		return nil, false, err
	}
	if err := r.Mkdir(dir, 0o700); err != nil {
		return nil, false, err
	}
	dirFd, err := r.openDir(dir, unix.O_PATH)
	if err != nil {
		return nil, false, err
	}
	defer unix.Close(dirFd)
	snapFd, err := r.openDir(snapshotsDir, unix.O_PATH)
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return nil, false, err
	}
	if err == nil {
		defer unix.Close(snapFd)
	}
	gone, unfinished := snapshotGonePrefix+nameHash(name), snapshotTemp(name)
	// The snapshot, or what a cut-short delete left of it, as gone; an unfinished copy under
	// its own name.
	for _, m := range []struct{ from, to string }{{name, gone}, {gone, gone}, {unfinished, unfinished}} {
		if snapFd < 0 {
			break
		}
		switch err := r.renameNoReplace(snapFd, m.from, dirFd, m.to); {
		case err == nil:
			moved = true
		case !errors.Is(err, unix.ENOENT) && !(m.from == gone && errors.Is(err, unix.EEXIST)):
			return nil, false, fmt.Errorf("move snapshot %s in %s to %s: %w", name, r.path, dir, err)
		}
	}
	for _, entry := range []string{gone, unfinished} {
		if err := unix.Fstatat(dirFd, entry, new(unix.Stat_t), unix.AT_SYMLINK_NOFOLLOW); err == nil {
			entries = append(entries, entry)
		} else if !errors.Is(err, unix.ENOENT) {
			return nil, false, fmt.Errorf("%s/%s in %s: %w", dir, entry, r.path, err)
		}
	}
	return entries, moved, nil
}

// SnapshotSource is the tree of the snapshot name, for MkdirAllFrom to restore it.
func (r *Root) SnapshotSource(name string) Source {
	return Source{Root: r, Rel: snapshotsDir + "/" + name + "/" + snapshotTree}
}

// removeSnapshotAt removes the snapshot directory name in dirFd, if there is one: its btrfs
// snapshot (read-only: removed by the ioctl, with its qgroup), then the rest as RemoveAll does.
func (r *Root) removeSnapshotAt(dirFd int, name string, mnt uint64) error {
	fd, err := r.openChild(dirFd, name, name)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	var (
		fs  *quota.FS
		lim quota.ID
	)
	if err == nil {
		tree, terr := openBeneath(fd, snapshotTree, unix.O_RDONLY|unix.O_DIRECTORY)
		if terr == nil {
			fs, lim, terr = r.unlimitSnapshot(fd, tree)
			sub := quota.IsSubvolume(tree)
			unix.Close(tree)
			if sub && terr == nil {
				terr = quota.DeleteSubvolume(fd, snapshotTree)
			}
		}
		unix.Close(fd)
		if terr != nil && !errors.Is(terr, unix.ENOENT) && !errors.Is(terr, unix.ENOTDIR) && !errors.Is(terr, unix.ELOOP) {
			return fmt.Errorf("%s: %w", name, terr)
		}
	} else if !errors.Is(err, ErrNotDirectory) {
		return err
	}
	if err := removeVolumeAt(dirFd, name, mnt); err != nil {
		return err
	}
	if lim.Kind == "" {
		return nil
	}
	if err := fs.Release(dirFd, lim); err != nil {
		return fmt.Errorf("%s: release its size limit: %w", name, err)
	}
	return nil
}

// unlimitSnapshot lifts the limit of the snapshot tree open at treeFd in the snapshot
// directory open at fd, if it has one of its own (a limited copy, a btrfs snapshot's qgroup),
// and returns it for Release once the tree is gone, as removeTemp does for a volume.
func (r *Root) unlimitSnapshot(fd, treeFd int) (*quota.FS, quota.ID, error) {
	fs, err := r.Quota()
	if err != nil || fs.Enforces() != nil {
		return nil, quota.ID{}, nil
	}
	id, ok, err := fs.IDOf(fd, treeFd)
	if err != nil || !ok {
		return nil, quota.ID{}, err
	}
	if err := fs.Unlimit(treeFd, id); err != nil {
		return nil, quota.ID{}, fmt.Errorf("size limit: %w", err)
	}
	return fs, id, nil
}

func checkSnapshotName(name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") || len(name) > maxSnapshotName {
		return fmt.Errorf("snapshot name %q: want one path component of at most %d bytes", name, maxSnapshotName)
	}
	if strings.HasPrefix(name, ReservedPrefix) {
		return fmt.Errorf("snapshot name %q %w", name, ErrReservedName)
	}
	return nil
}

// snapshotTemp is where the snapshot name is made before it is renamed into place.
func snapshotTemp(name string) string { return tempPrefix + nameHash(name) }

func nameHash(name string) string {
	sum := sha256.Sum256([]byte("snapshot\x00" + name))
	return hex.EncodeToString(sum[:16])
}

// writeFileAt creates name in dirFd holding b, on disk before it returns.
func writeFileAt(dirFd int, name string, b []byte) error {
	fd, err := openBeneath(dirFd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL)
	if err != nil {
		return fmt.Errorf("create %s: %w", name, err)
	}
	return writeSynced(fd, name, b)
}

// writeSynced writes b to the new file open at fd, syncs and closes it.
func writeSynced(fd int, name string, b []byte) error {
	f := os.NewFile(uintptr(fd), name)
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", name, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync %s: %w", name, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", name, err)
	}
	return nil
}
