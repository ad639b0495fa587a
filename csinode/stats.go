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
)

// NodeGetVolumeStats reports the capacity and inodes of the file system behind a published
// volume. dirpv sets no quota, so these are the figures of the whole file system holding the
// volume (the NFS export, or the local base path's file system), which is what a pod sees.
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
	sfs, err := s.d.statfsBounded(ctx, p)
	if err != nil {
		return nil, toStatus(err)
	}
	bsize := sfs.Frsize
	if bsize == 0 {
		bsize = sfs.Bsize
	}
	// Counts come as uint64; clamp so that a bogus file system cannot make them negative.
	i64 := func(v uint64) int64 { return int64(min(v, 1<<63-1)) }
	total, free, avail := sfs.Blocks*uint64(bsize), sfs.Bfree*uint64(bsize), sfs.Bavail*uint64(bsize)
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{
		Unit:      csi.VolumeUsage_BYTES,
		Total:     i64(total),
		Available: i64(avail),
		Used:      i64(total - min(free, total)),
	}, {
		Unit:      csi.VolumeUsage_INODES,
		Total:     i64(sfs.Files),
		Available: i64(sfs.Ffree),
		Used:      i64(sfs.Files - min(sfs.Ffree, sfs.Files)),
	}}}, nil
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
