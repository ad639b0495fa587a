package volume

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

// ErrReplaced is returned by a Volume's Rename, Move and Remove when the name the volume had
// when it was opened now holds another directory: the checked one was removed or moved away
// by someone else, and another put in its place. The other directory is left where it was.
var ErrReplaced = errors.New("another directory is there now, not the one that was checked; left alone")

// removalPrefix names volumes being removed: removalPrefix + a hash of the name and the key of
// the Remove.
const removalPrefix = ReservedPrefix + "del-"

// Volume is a volume directory as it was when it was opened and judged: its identity (device
// and inode, held open so that the inode number cannot pass to a new directory meanwhile) and
// its marker. Its Rename, Move and Remove act on that directory or on nothing: a decision
// taken on what the directory's marker said never applies to another directory that took its
// name since, as a second lookup of the name would let it. Close it when done.
type Volume struct {
	root *Root
	// parent ("" for the base) and name are where the volume is now.
	parent, name string
	fd           int
	dev, ino     uint64
	marker       marker
}

// OpenVolume opens the volume directory rel, to judge it by its marker (Owner) and then act on
// exactly it. It fails with an error wrapping os.ErrNotExist if rel does not exist, and
// ErrNotDirectory if it, or a component on the way, is no directory (a symlink included).
func (r *Root) OpenVolume(rel string) (*Volume, error) {
	parentFd, name, err := r.parentOf(rel)
	if err != nil {
		return nil, err
	}
	defer unix.Close(parentFd)
	parent, _ := split(rel)
	// Readable, not O_PATH: the marker is an attribute of the directory itself where it can be.
	fd, err := r.openChild(parentFd, name, rel)
	if err != nil {
		return nil, err
	}
	v := &Volume{root: r, parent: parent, name: name, fd: fd}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		v.Close()
		return nil, fmt.Errorf("stat %s in %s: %w", rel, r.path, err)
	}
	v.dev, v.ino = st.Dev, st.Ino
	if v.marker, err = r.readMarker(parentFd, fd); err != nil {
		v.Close()
		return nil, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	return v, nil
}

// OpenRemoval opens what a Remove of the volume rel with key left under its private name when
// it was stopped before the tree was gone (a crash), so that a retry can finish it. It fails
// with an error wrapping os.ErrNotExist if nothing was left.
func (r *Root) OpenRemoval(rel, key string) (*Volume, error) {
	if _, err := CleanRelPath(rel); err != nil {
		return nil, err
	}
	parent, name := split(rel)
	return r.OpenVolume(path.Join(parent, removalName(name, key)))
}

// removalName is where Remove with key puts the directory name before removing it: the same
// for every attempt, so that a retry finds what an interrupted one left.
func removalName(name, key string) string {
	sum := sha256.Sum256([]byte(key + "\x00" + name))
	return removalPrefix + hex.EncodeToString(sum[:16])
}

// Owner returns the claim the volume's marker named when it was opened. marked is false if it
// had no marker; owner is empty if the marker named no claim (a volume made before dirpv
// recorded owners).
func (v *Volume) Owner() (owner Claim, marked bool) { return v.marker.owner, v.marker.marked }

// Rel is where the volume is now, relative to its root.
func (v *Volume) Rel() string { return path.Join(v.parent, v.name) }

// Close releases the volume's directory.
func (v *Volume) Close() error {
	if v.fd < 0 {
		return nil
	}
	err := unix.Close(v.fd)
	v.fd = -1
	return err
}

// Rename gives the volume newName in its parent directory, failing if newName exists. It fails
// with ErrReplaced, changing nothing, if another directory has taken the volume's name, and
// with an error wrapping os.ErrNotExist if nothing has.
func (v *Volume) Rename(newName string) error { return v.Move(v.parent, newName) }

// Move moves the volume into the directory dir ("" for the base) as newName, as Rename does.
func (v *Volume) Move(dir, newName string) error {
	if _, err := CleanRelPath(newName); err != nil || strings.Contains(newName, "/") {
		return fmt.Errorf("new name %q must be a single path component", newName)
	}
	return v.move(dir, newName)
}

// Remove removes the volume's tree, as Root.RemoveLimited does for a volume limited by id (as
// Root.RemoveAll for the zero ID), limit released included. The directory first gets a private
// name in its parent, the same for every attempt with key, and only the directory that was
// opened is removed from there; a retry after a crash finds the rest with OpenRemoval. It
// fails with ErrReplaced, removing nothing, if another directory has taken the volume's name,
// and with an error wrapping os.ErrNotExist if nothing has. Once the removal starts, the
// Volume is closed.
func (v *Volume) Remove(key string, id quota.ID) error {
	if !strings.HasPrefix(v.name, removalPrefix) {
		if err := v.move(v.parent, removalName(v.name, key)); err != nil {
			return err
		}
	}
	// The removal opens what it needs itself: a btrfs subvolume, for one, is deleted by its
	// name, which no other directory can take now.
	v.Close()
	if id.Kind == "" {
		return v.root.RemoveAll(v.Rel())
	}
	return v.root.RemoveLimited(v.Rel(), id)
}

// move renames the volume to newName in dir, then checks that what went there is the directory
// that was opened; if it is not (the volume's name had been taken by another directory), it is
// put back and ErrReplaced returned. Renaming first makes the check final: nothing takes a
// name dirpv has just given.
func (v *Volume) move(dir, newName string) error {
	r := v.root
	if v.fd < 0 {
		return fmt.Errorf("%s in %s: the volume is closed", v.Rel(), r.path)
	}
	rel := v.Rel()
	parentFd, err := r.openDir(v.parent, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(parentFd)
	dirFd, err := r.openDir(dir, unix.O_PATH)
	if err != nil {
		return err
	}
	defer unix.Close(dirFd)
	target := path.Join(dir, newName)
	if err := r.renameNoReplace(parentFd, v.name, dirFd, newName); err != nil {
		return fmt.Errorf("rename %s to %s in %s: %w", rel, target, r.path, err)
	}
	across := path.Clean("/"+dir) != path.Clean("/"+v.parent)
	if across {
		moveRecord(parentFd, dirFd, newName)
	}
	same, err := v.isAt(dirFd, newName, target)
	if err == nil && same {
		v.parent, v.name = dir, newName
		return nil
	}
	if err == nil {
		err = fmt.Errorf("%s in %s: %w", rel, r.path, ErrReplaced)
	} else {
		err = fmt.Errorf("%s in %s: check what was renamed to %s: %w", rel, r.path, target, err)
	}
	// Put back what was not to be moved.
	if berr := r.renameNoReplace(dirFd, newName, parentFd, v.name); berr != nil {
		return errors.Join(err, fmt.Errorf("rename %s back to %s: %w", target, rel, berr))
	}
	if across {
		moveRecord(dirFd, parentFd, v.name)
	}
	return err
}

// isAt reports whether name in dirFd is the volume's directory: the same device and inode,
// and, since over NFS an inode number can pass to a directory made after the volume's was
// removed on the server, no marker that names another claim. A marker that seems gone after a
// move across directories (its record file is moved best effort) does not count against it.
func (v *Volume) isAt(dirFd int, name, where string) (bool, error) {
	fd, err := v.root.openChild(dirFd, name, where)
	if errors.Is(err, ErrNotDirectory) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, fmt.Errorf("stat: %w", err)
	}
	if st.Dev != v.dev || st.Ino != v.ino {
		return false, nil
	}
	m, err := v.root.readMarker(dirFd, fd)
	if err != nil {
		return false, err
	}
	return !m.marked || (m.marked == v.marker.marked && m.owner == v.marker.owner), nil
}

// OpenVolumeOf opens the volume directory at rel and refuses it if its marker names another
// claim than owner: a stale PV's Delete, retried after its directory was removed and made anew
// for another claim of a pattern without ${pv.metadata.name}, must not destroy that claim's
// data. Directories that name no claim (made before markers recorded owners) are owner's. It
// returns nil if nothing is at rel, and an error wrapping ErrNotDirectory if what is
// there is no directory. The caller acts on the directory returned, never on rel again:
// another directory may have taken that name since (ErrReplaced).
func (r *Root) OpenVolumeOf(rel string, owner Claim) (*Volume, error) {
	vol, err := r.OpenVolume(rel)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if !vol.OwnedBy(owner) {
		vol.Close()
		return nil, fmt.Errorf("directory %s now belongs to another claim's volume, not to this PV's claim; leaving it alone", rel)
	}
	return vol, nil
}

// OwnedBy reports whether v's marker names c, by its UID if c has one, else by its PV's
// name, or no claim at all.
func (v *Volume) OwnedBy(c Claim) bool {
	got, _ := v.Owner()
	if c.UID != "" {
		return got.UID == "" || got.UID == c.UID
	}
	return got.UID == "" || got.PVName == c.PVName
}
