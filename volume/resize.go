package volume

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume/quota"
)

// ErrNotEnoughSpace is returned by Resize when a volume's growth does not fit in its base's
// free space.
var ErrNotEnoughSpace = errors.New("not enough free space in the base")

// ErrNotClaimsVolume is returned by Resize when the directory is not marked as the claim's
// volume.
var ErrNotClaimsVolume = errors.New("is not this claim's volume")

// Resize raises the size limit of the volume directory rel, whose marker must name claim, to
// bytes (rounded up to the file system's unit). The directory is opened beneath the root
// without following symlinks, and its quota is the one its marker records, whatever a PV
// says. It reports false, changing nothing, for a volume made without a limit: its size is
// only recorded. A limit is never lowered: the API server only lets a claim shrink back to a
// size at or above what it was granted, and a limit below what the volume holds would fail
// every write in it. Growth that does not fit in the base's free space (Available) fails with
// an error wrapping ErrNotEnoughSpace. Free space is what the base has now: limits of other
// volumes that are not used up yet are not reserved, as they are not at creation either.
func (r *Root) Resize(rel string, claim Claim, bytes uint64) (limited bool, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return false, err
	}
	if bytes == 0 {
		return false, fmt.Errorf("volume %s: a limit of 0 bytes", rel)
	}
	parent, name := split(rel)
	parentFd, err := r.openDir(parent, unix.O_PATH)
	if err != nil {
		return false, err
	}
	defer unix.Close(parentFd)
	fd, err := r.openChild(parentFd, name, rel)
	if err != nil {
		return false, err
	}
	defer unix.Close(fd)
	m, err := r.readMarker(parentFd, fd)
	if err != nil {
		return false, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	if !m.marked || claim.UID == "" || m.owner.UID != claim.UID {
		return false, fmt.Errorf("directory %s in %s %w", rel, r.path, ErrNotClaimsVolume)
	}
	if m.quota == "" {
		return false, nil
	}
	id, err := quota.ParseID(m.quota)
	if err != nil {
		return false, fmt.Errorf("%s in %s: volume marker: %w", rel, r.path, err)
	}
	fs, err := r.Quota()
	if err != nil {
		return false, err
	}
	u, err := fs.Usage(fd, id)
	if err != nil {
		return false, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	want := fs.Round(bytes)
	if u.LimitBytes != 0 && want <= u.LimitBytes {
		return true, nil
	}
	avail, err := r.Available()
	if err != nil {
		return false, err
	}
	// What the volume already holds is on disk, counted in avail: only the rest of the new
	// limit is growth (a volume whose limit was cleared may hold more than its old limit).
	if growth := want - min(want, max(u.LimitBytes, u.UsedBytes)); growth > avail {
		return false, fmt.Errorf("growing volume %s from %d to %d bytes takes %d more bytes, base %s has %d free: %w",
			rel, u.LimitBytes, want, growth, r.path, avail, ErrNotEnoughSpace)
	}
	failpoint.Reach(failpoint.ResizeChecked)
	if err := fs.Resize(fd, id, bytes); err != nil {
		return false, fmt.Errorf("%s in %s: %w", rel, r.path, err)
	}
	return true, nil
}
