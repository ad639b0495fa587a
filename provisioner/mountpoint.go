package provisioner

import (
	"errors"
	"fmt"
	"path/filepath"

	v1 "k8s.io/api/core/v1"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/local"
)

// BasePathMountPoint is what a local class asks of its base path: whether a file system must
// be mounted there.
type BasePathMountPoint string

const (
	// MountPointRequired refuses to create or delete volumes under a base path that is not a
	// mount point: its disk did not mount, and the directory underneath is the root file
	// system's. Unlike the base's identity (volume.BaseRecords), this holds from the first
	// use of the base on a node, before dirpv has anything to compare with.
	MountPointRequired BasePathMountPoint = "required"
	// MountPointOptional lets the base path be any directory.
	MountPointOptional BasePathMountPoint = "optional"
)

// AnnBasePathMountPoint on a PV says its base path must be a mount point, as its class did:
// Delete does not need the class, which may be gone. An annotation, not a volume attribute:
// an admin who gives up on the disk (its volumes gone) can remove it, and spec.csi is
// immutable.
const AnnBasePathMountPoint = "dirpv.io/base-path-mount-point"

// ReasonBasePathNotMounted is the event reason on a claim or PV whose class requires its base
// path to be a mount point, where none is.
const ReasonBasePathNotMounted = "BasePathNotMounted"

// notMountedError refuses a base path that must be a mount point and is not. It is a kind of
// volume.ErrBaseChanged, so that it is handled as that is (the claim waits for its disk, the
// PV stays, the node publishes no room), and carries a message of its own.
type notMountedError struct{ msg string }

func (e *notMountedError) Error() string { return e.msg }

func (e *notMountedError) Is(target error) bool { return target == volume.ErrBaseChanged }

func isNotMounted(err error) bool {
	var nm *notMountedError
	return errors.As(err, &nm)
}

// mountPointRequired reports whether the PV's base path must be a mount point.
func mountPointRequired(pv *v1.PersistentVolume) bool {
	return pv.Annotations[AnnBasePathMountPoint] == string(MountPointRequired)
}

// doMounted runs fn on the root of basePath, which is beneath allowed, if basePath is a mount
// point; nothing is created on the way, since a mount point exists. The check is made on the
// directory that fn gets, not merely on the path: a root held open from before an unmount
// is not the directory the path leads to now.
//
// basePath must lie strictly beneath the allowed base: the node plugin's pod reaches each
// allowed base through a hostPath volume, a bind mount that is a mount point in the pod
// whether or not the host has the disk mounted there, so the check could never fail there.
// Beneath it, the pod sees the host's mounts as the host does (HostToContainer).
func doMounted(l *local.Bases, allowed, basePath string, fn func(*volume.Root) error) error {
	rel, err := filepath.Rel(allowed, basePath)
	if err != nil {
		return fmt.Errorf("%w: base path %s beneath %s: %w", local.ErrUnusable, basePath, allowed, err)
	}
	if rel == "." {
		return &notMountedError{fmt.Sprintf("base path %s must be a mount point (%s: %s), but it is the allowed base path itself, "+
			"which the node plugin's pod mounts from the host: there it is a mount point whether or not a disk is mounted "+
			"on the host. Mount the disk at a directory beneath %s and name that directory as the class's %s",
			basePath, ParamBasePathMountPoint, MountPointRequired, allowed, ParamBasePath)}
	}
	checked, err := local.OpenBase(allowed, basePath, false)
	if isNotExist(err) {
		return &notMountedError{fmt.Sprintf("base path %s must be a mount point (%s: %s), but it does not exist (%v): "+
			"the disk meant to be mounted there is probably not mounted. dirpv creates and deletes no volume there until it is, "+
			"and carries on by itself then: mount the disk at %s on this node",
			basePath, ParamBasePathMountPoint, MountPointRequired, err, basePath)}
	}
	if err != nil {
		return fmt.Errorf("%w: %w", local.ErrUnusable, err)
	}
	defer checked.Close()
	if err := checkMountPoint(checked); err != nil {
		return err
	}
	return l.Do(allowed, basePath, func(root *volume.Root) error {
		if same, err := root.SameDirectory(checked); err != nil {
			return fmt.Errorf("%w: %w", local.ErrUnusable, err)
		} else if !same {
			// Mounted or unmounted between the two looks: the next attempt sees which.
			return &notMountedError{fmt.Sprintf("base path %s changed while it was checked for a mount point: "+
				"a file system was mounted or unmounted there; dirpv tries again", basePath)}
		}
		return fn(root)
	})
}

// checkMountPoint refuses root unless it is a mount point.
func checkMountPoint(root *volume.Root) error {
	mounted, err := root.IsMountPoint()
	if err != nil {
		return fmt.Errorf("%w: %w", local.ErrUnusable, err)
	}
	if !mounted {
		return &notMountedError{fmt.Sprintf("base path %s must be a mount point (%s: %s), but no file system is mounted there: "+
			"the disk meant to be mounted there is probably not mounted. dirpv creates and deletes no volume there until it is, "+
			"and carries on by itself then: mount the disk at %s on this node",
			root.Path(), ParamBasePathMountPoint, MountPointRequired, root.Path())}
	}
	return nil
}
