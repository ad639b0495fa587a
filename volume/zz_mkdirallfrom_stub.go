package volume

// TEMPORARY stand-in for 15-C's API (branch wt-copy) so that the provisioner side builds
// before it lands; removed when wt-copy is merged. It copies nothing.

import (
	"context"

	"github.com/dirpv/dirpv/volume/quota"
)

// Source is the tree a new volume starts as a copy of.
type Source struct {
	Root *Root
	Rel  string
}

// CopyStats says what a copy did.
type CopyStats struct{}

// MkdirAllFrom is MkdirAll(Limited) for a volume that starts as a copy of src.
func (r *Root) MkdirAllFrom(ctx context.Context, rel string, claim Claim, limit uint64, src Source) (created bool, id quota.ID, stats CopyStats, err error) {
	created, id, err = r.mkdirAll(rel, Owner{Mode: 0o777, UID: -1, GID: -1}, claim, limit)
	return created, id, CopyStats{}, err
}
