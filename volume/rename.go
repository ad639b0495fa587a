package volume

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/internal/keyed"
)

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
// It is the one place that renames into place without replacing, and it owns the recovery
// from its own crash: every caller (new volumes, snapshots, archive, trash) retries the same
// rename after a crash, and finds the name free again.
func (r *Root) renameNoReplace(parentFd int, name string, dirFd int, newName string) error {
	err := renameat2(parentFd, name, dirFd, newName, unix.RENAME_NOREPLACE)
	if !errors.Is(err, unix.EINVAL) {
		return err
	}
	// NFS (the kernel client, and so the test helper) has no RENAME_NOREPLACE. Claim the name,
	// then rename, one at a time per target in this process; dirpv's NFS volumes are all made
	// by the one leader, so the race left is with a process outside dirpv writing the export.
	// A crash between the two leaves an empty placeholder at newName beside name, which is
	// still whole; the retry drops the placeholder (dropPlaceholder) and renames.
	var dir unix.Stat_t
	if err := unix.Fstat(dirFd, &dir); err != nil {
		return fmt.Errorf("stat target directory: %w", err)
	}
	defer renameLocks.MustLock(renameTarget{dirIno: dir.Ino, name: newName})()
	// Under the lock, a placeholder is never one a live rename of this process made.
	if err := r.dropPlaceholder(dirFd, newName); err != nil {
		return err
	}
	// The check is the server's, not a stat: a mount's cached lookup can still miss a directory
	// that another mount of the export (a class with other mount options, its own superblock
	// and caches) renamed into place an instant ago, and the rename would then replace that
	// empty new volume, handing one directory to two claims (TestSameNameClaimsAcrossMounts,
	// 1 round in many). The server decides a mkdir, and the rename replaces the empty
	// directory it made.
	if err := unix.Mkdirat(dirFd, newName, placeholderMode); err != nil {
		return err
	}
	failpoint.Hit(failpoint.RenameClaimed)
	if err := unix.Renameat(parentFd, name, dirFd, newName); err != nil {
		if rerr := unix.Unlinkat(dirFd, newName, unix.AT_REMOVEDIR); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove the placeholder %s: %w", newName, rerr))
		}
		return err
	}
	return nil
}

// placeholderMode is the mode of the directory that claims a name on NFS: no volume, snapshot
// or trash entry is an empty, unmarked directory of mode 0.
const placeholderMode = 0

// dropPlaceholder removes what a crash inside renameNoReplace's NFS path leaves at name in
// dirFd: an empty directory of placeholderMode that carries no volume marker. Without this,
// the retry of the rename found a directory that is no volume, snapshot or trash entry, and
// failed on it for good (a leader killed at that instant, TestControllerLeaderKilledMidway;
// an NFS snapshot copied again on every retry and thrown away, TestSnapshotRenameCrash).
// Anything else at name is left alone; rmdir removes only an empty directory.
func (r *Root) dropPlaceholder(dirFd int, name string) error {
	if !r.isPlaceholder(dirFd, name) {
		return nil
	}
	if err := unix.Unlinkat(dirFd, name, unix.AT_REMOVEDIR); err != nil &&
		!errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove the placeholder a crash left at %s: %w", name, err)
	}
	return nil
}

// isPlaceholder reports whether name in dirFd looks like renameNoReplace's placeholder (its
// emptiness is for rmdir to decide).
func (r *Root) isPlaceholder(dirFd int, name string) bool {
	var st unix.Stat_t
	if err := unix.Fstatat(dirFd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil ||
		st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Mode&0o7777 != placeholderMode {
		return false
	}
	fd, err := r.openChild(dirFd, name, name)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	m, err := r.readMarker(dirFd, fd)
	return err == nil && !m.marked
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
