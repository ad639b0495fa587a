package provisioner

import (
	"time"

	"github.com/dirpv/dirpv/volume/export"
)

// ExportStatus is what the controller knows about one NFS export it mounts.
type ExportStatus = export.Status

// Exports reports on every NFS export this controller knows (export.Exports.Status); none on a
// node instance, which mounts no export.
func (p *Provisioner) Exports() []ExportStatus {
	if p.exports == nil {
		return nil
	}
	return p.exports.Status()
}

// Healthy returns an error if an NFS export is wedged for longer than limit
// (export.Exports.Healthy). A limit of zero or less disables the check.
func (p *Provisioner) Healthy(limit time.Duration) error {
	if p.exports == nil {
		return nil
	}
	return p.exports.Healthy(limit)
}
