package csinode

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota"
)

// NodeGetVolumeStats reports the capacity and inodes of a published volume. A volume with a
// size limit reports its own figures, from its quota: what it holds, and what it may still
// take (its limit, or less if the file system has less left). Other volumes (NFS, local ones on
// a base without quota) report the file system holding them, which is what a pod sees there.
// Nothing walks the volume's tree: the quota is one query.
func (s *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	if req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume path is required")
	}
	p := filepath.Clean(req.GetVolumePath())
	if err := s.d.checkPublished(req.GetVolumeId(), p); err != nil {
		return nil, err
	}
	st, err := s.d.volumeStats(ctx, p)
	if err != nil {
		return nil, toStatus(err)
	}
	sfs := &st.fs
	bsize := sfs.Frsize
	if bsize == 0 {
		bsize = sfs.Bsize
	}
	// Counts come as uint64; clamp so that a bogus file system cannot make them negative.
	i64 := func(v uint64) int64 { return int64(min(v, 1<<63-1)) }
	total, free, avail := sfs.Blocks*uint64(bsize), sfs.Bfree*uint64(bsize), sfs.Bavail*uint64(bsize)
	used := total - min(free, total)
	inodes, inodesFree := sfs.Files, sfs.Ffree
	inodesUsed := inodes - min(inodesFree, inodes)
	if q := st.quota; q != nil && q.LimitBytes > 0 {
		total, used = q.LimitBytes, q.UsedBytes
		avail = min(avail, total-min(used, total))
		if q.HasInodes {
			// Without an inode limit, the volume may take what the file system has left.
			inodesUsed = q.UsedInodes
			if q.LimitInodes > 0 {
				inodesFree = min(inodesFree, q.LimitInodes-min(inodesUsed, q.LimitInodes))
			}
			inodes = inodesUsed + inodesFree
		}
	}
	return statsResponse(i64(total), i64(avail), i64(used), i64(inodes), i64(inodesFree), i64(inodesUsed)), nil
}

func statsResponse(total, avail, used, inodes, inodesFree, inodesUsed int64) *csi.NodeGetVolumeStatsResponse {
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{
		Unit: csi.VolumeUsage_BYTES, Total: total, Available: avail, Used: used,
	}, {
		Unit: csi.VolumeUsage_INODES, Total: inodes, Available: inodesFree, Used: inodesUsed,
	}}}
}

// stats are what NodeGetVolumeStats reports from: the file system's figures, and the
// volume's quota where it has one.
type stats struct {
	fs    unix.Statfs_t
	quota *quota.Usage
}

// volumeStats reads the statfs figures of the published volume at path and, if its marker
// names a quota, the quota's usage, under the operation deadline. The marker is a trusted
// attribute of the volume directory (the mount's root), which the provisioner wrote with the
// same ID as the PV's quota attribute: NodeGetVolumeStats carries no volume context, and the
// marker survives node plugin restarts. A tenant can neither forge nor remove it.
func (d *Driver) volumeStats(ctx context.Context, path string) (*stats, error) {
	var st stats
	err := d.statfs.do(ctx, path, "stats of "+path, d.opts.OperationTimeout, func() error {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
		if err != nil {
			return fmt.Errorf("open: %w", err)
		}
		defer unix.Close(fd)
		if err := unix.Fstatfs(fd, &st.fs); err != nil {
			return fmt.Errorf("statfs: %w", err)
		}
		id, ok, err := volume.VolumeQuota(fd)
		if err != nil || !ok {
			return err
		}
		fs, err := quota.Probe(fd)
		if err != nil {
			return err
		}
		u, err := fs.Usage(fd, id)
		if err != nil {
			return fmt.Errorf("volume quota %s: %w", id, err)
		}
		st.quota = &u
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("stats of %s: %w", path, err)
	}
	return &st, nil
}

// checkPublished answers NotFound unless path is a mount point and, as far as this process
// knows, one of volumeID's. It reads only the mount table, never the mounted file system.
func (d *Driver) checkPublished(volumeID, path string) error {
	if !filepath.IsAbs(path) {
		return status.Errorf(codes.NotFound, "volume %s is not published at %q (not an absolute path)", volumeID, path)
	}
	mps, err := d.mountsAt(path)
	if err != nil {
		return toStatus(err)
	}
	if len(mps) == 0 {
		return status.Errorf(codes.NotFound, "volume %s is not published at %s (not a mount point)", volumeID, path)
	}
	if owner := d.published.owner(path); owner != "" && owner != volumeID {
		return status.Errorf(codes.NotFound, "%s holds volume %s, not %s", path, owner, volumeID)
	}
	return nil
}

// statfsBounded runs statfs(2) under the operation deadline, at most one per path at a time.
func (d *Driver) statfsBounded(ctx context.Context, path string) (*unix.Statfs_t, error) {
	var sfs unix.Statfs_t
	err := d.statfs.do(ctx, path, "statfs "+path, d.opts.OperationTimeout, func() error {
		return unix.Statfs(path, &sfs)
	})
	if err != nil {
		return nil, fmt.Errorf("statfs %s: %w", path, err)
	}
	return &sfs, nil
}

// NodeGetVolumeHealth reports a volume INACCESSIBLE where statfs on its mount fails or hangs,
// which is how a dead NFS server or a deleted local directory shows. Without a publish path it
// checks the targets this process published the volume at.
func (s *nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	var paths []string
	if p := req.GetVolumePublishPath(); p != "" {
		paths = []string{filepath.Clean(p)}
	} else {
		paths = s.d.published.list(id)
	}
	if len(paths) == 0 {
		return nil, status.Errorf(codes.NotFound, "volume %s is not published by this node plugin", id)
	}
	// The spec allows one entry per (status, reason): problems at several targets are merged.
	var notMounted, statfsFailed []string
	for _, p := range paths {
		if err := s.d.checkPublished(id, p); err != nil {
			notMounted = append(notMounted, status.Convert(err).Message())
			continue
		}
		if _, err := s.d.statfsBounded(ctx, p); err != nil {
			statfsFailed = append(statfsFailed, err.Error())
		}
	}
	health := &csi.VolumeHealth{VolumeId: id}
	for _, e := range []struct {
		reason string
		msgs   []string
	}{{"NotMounted", notMounted}, {"StatfsFailed", statfsFailed}} {
		if len(e.msgs) > 0 {
			health.HealthStatuses = append(health.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
				Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: e.reason,
				Message: strings.Join(e.msgs, "; "),
			})
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: health}, nil
}
