package volume

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

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
