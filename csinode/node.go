package csinode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume"
)

// nodeServer answers the CSI Node service.
type nodeServer struct {
	csi.UnimplementedNodeServer
	d *Driver
}

// singleNodeModes are the access modes a local volume, which exists on one node, can serve.
var singleNodeModes = []csi.VolumeCapability_AccessMode_Mode{
	csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
	csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
}

// multiNodeModes are the further modes an NFS volume can serve.
var multiNodeModes = []csi.VolumeCapability_AccessMode_Mode{
	csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
	csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
	csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
}

// localMountFlags are the mount options a local bind mount accepts: per-mount VFS flags.
// Anything else (an NFS option copied from a class, say) is refused rather than ignored.
var localMountFlags = []string{
	"ro", "rw", "nosuid", "suid", "nodev", "dev", "noexec", "exec",
	"noatime", "atime", "nodiratime", "diratime", "relatime", "norelatime", "strictatime",
}

// publishRequest is a validated NodePublishVolumeRequest.
type publishRequest struct {
	volumeID string
	target   string
	attrs    volume.Attributes
	mode     csi.VolumeCapability_AccessMode_Mode
	flags    []string
	readonly bool
	// localBase and localRel locate a local volume's directory: the allowed base that holds
	// it, and its path beneath that base, opened with no symlink followed.
	localBase, localRel string
}

// ephemeralKey is set by kubelet (podInfoOnMount) to "true" for a CSI inline ephemeral volume.
const ephemeralKey = "csi.storage.k8s.io/ephemeral"

func (d *Driver) validatePublish(req *csi.NodePublishVolumeRequest) (*publishRequest, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	// An inline volume's attributes come from the pod spec, so any pod author could name a
	// basePath. The CSIDriver declares only Persistent, so kubelet should never ask; refuse if
	// it does.
	if v, err := strconv.ParseBool(req.GetVolumeContext()[ephemeralKey]); err == nil && v {
		return nil, status.Error(codes.InvalidArgument, "dirpv does not serve CSI inline ephemeral volumes: "+
			"use a generic ephemeral volume (spec.volumes[].ephemeral.volumeClaimTemplate with a dirpv StorageClass) instead")
	}
	target, err := checkAbsPath("target path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	vc := req.GetVolumeCapability()
	if vc == nil {
		return nil, status.Error(codes.InvalidArgument, "volume capability is required")
	}
	if vc.GetBlock() != nil {
		return nil, status.Error(codes.InvalidArgument, "block access is not supported: dirpv volumes are directories")
	}
	if vc.GetMount() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume capability must have access type mount")
	}
	attrs, err := volume.ParseAttributes(req.GetVolumeContext())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "volume context: %v", err)
	}
	mode := vc.GetAccessMode().GetMode()
	allowed := singleNodeModes
	if attrs.Backend == volume.BackendNFS {
		allowed = append(slices.Clone(singleNodeModes), multiNodeModes...)
	}
	if !slices.Contains(allowed, mode) {
		return nil, status.Errorf(codes.InvalidArgument, "access mode %s is not supported by %s volumes", mode, attrs.Backend)
	}
	flags := vc.GetMount().GetMountFlags()
	if attrs.Backend == volume.BackendLocal {
		for _, f := range flags {
			if !slices.Contains(localMountFlags, f) {
				return nil, status.Errorf(codes.InvalidArgument, "mount option %q is not valid for a local (bind-mounted) volume; allowed: %v", f, localMountFlags)
			}
		}
	}
	readonly := req.GetReadonly() ||
		mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY ||
		mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	pr := &publishRequest{
		volumeID: req.GetVolumeId(), target: target, attrs: attrs,
		mode: mode, flags: flags, readonly: readonly,
	}
	if attrs.Backend == volume.BackendLocal {
		// PermissionDenied, not InvalidArgument: the request is well formed, and whether it may
		// be served depends on this node's configuration (--allowed-base-paths), not on the
		// request alone. Both are final for kubelet, which shows the message in the pod's events.
		if pr.localBase, pr.localRel, err = d.opts.LocalBases.Locate(attrs.BasePath, attrs.Path); err != nil {
			return nil, status.Error(codes.PermissionDenied, err.Error())
		}
	}
	return pr, nil
}

func checkAbsPath(what, p string) (string, error) {
	if p == "" {
		return "", status.Errorf(codes.InvalidArgument, "%s is required", what)
	}
	if !filepath.IsAbs(p) {
		return "", status.Errorf(codes.InvalidArgument, "%s %q must be absolute", what, p)
	}
	return filepath.Clean(p), nil
}

func lockKey(volumeID, target string) string { return volumeID + "\x00" + target }

// NodePublishVolume mounts the volume at the target path: NFS volumes by mounting
// server:/share/path with the PV's mount options, local volumes by bind-mounting their
// directory, opened beneath the allowed base that holds it without following symlinks.
func (s *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	pr, err := s.d.validatePublish(req)
	if err != nil {
		return nil, err
	}
	scope, err := s.d.locks.lock(ctx, lockKey(pr.volumeID, pr.target), s.d.opts.OperationTimeout)
	if err != nil {
		return nil, toStatus(err)
	}
	defer scope.release()
	switch pr.attrs.Backend {
	case volume.BackendLocal:
		err = s.d.publishLocal(ctx, scope, pr)
	case volume.BackendNFS:
		err = s.d.publishNFS(ctx, scope, pr)
	}
	if err != nil {
		return nil, toStatus(err)
	}
	s.d.published.add(pr.volumeID, pr.target)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *Driver) publishLocal(ctx context.Context, scope *opScope, pr *publishRequest) error {
	logger := klog.FromContext(ctx)
	root, err := volume.OpenRoot(pr.localBase)
	if err != nil {
		return fmt.Errorf("local volume base: %w", err)
	}
	defer root.Close()
	dir, err := root.OpenDir(pr.localRel)
	if err != nil {
		return fmt.Errorf("local volume directory: %w", err)
	}
	defer dir.Close()
	var src unix.Stat_t
	if err := unix.Fstat(int(dir.Fd()), &src); err != nil {
		return fmt.Errorf("stat volume directory %s: %w", dir.Name(), err)
	}

	existing, err := d.mountsAt(pr.target)
	if err != nil {
		return err
	}
	if len(existing) > 0 {
		var tst unix.Stat_t
		if err := scope.call(ctx, "stat "+pr.target, func() error { return unix.Stat(pr.target, &tst) }); err != nil {
			return fmt.Errorf("check existing mount at %s: %w", pr.target, err)
		}
		if tst.Dev == src.Dev && tst.Ino == src.Ino && isReadOnly(existing[len(existing)-1]) == pr.readonly {
			logger.V(2).Info("Volume already published at target")
			return nil
		}
		return status.Errorf(codes.AlreadyExists, "%s is already mounted, but not with volume directory %s (read-only %t)", pr.target, dir.Name(), pr.readonly)
	}
	if pr.mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		others, err := bindMountsOf(ctx, scope, src.Dev, src.Ino, pr.target)
		if err != nil {
			return err
		}
		if len(others) > 0 {
			return status.Errorf(codes.FailedPrecondition, "access mode SINGLE_NODE_SINGLE_WRITER: volume is already published at %v", others)
		}
	}

	created, err := makeTarget(pr.target)
	if err != nil {
		return err
	}
	// The bind source is our own handle on the directory, through /proc: whatever is renamed
	// or symlinked into the path after OpenDir checked it, the mount gets exactly this
	// directory. --no-canonicalize matters: without it mount(8) resolves the magic link back to
	// a path string and looks that up again. The duplicate descriptor stays open until mount(8)
	// has finished even if we stop waiting for it, so its number cannot be reused meanwhile.
	fd, err := unix.FcntlInt(dir.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("duplicate volume directory handle: %w", err)
	}
	source := fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)
	// "ro" goes last: mount(8) lets a later option win, and a PV's "rw" must not undo a
	// read-only publish.
	opts := append([]string{"bind"}, pr.flags...)
	if pr.readonly {
		opts = append(opts, "ro")
	}
	err = scope.call(ctx, "bind mount of "+dir.Name()+" at "+pr.target, func() error {
		defer unix.Close(fd)
		return d.mounter.MountSensitiveWithoutSystemdWithMountFlags(source, pr.target, "", opts, nil, []string{"--no-canonicalize"})
	})
	if err != nil {
		if !isTimeout(err) {
			d.removeUnmountedTarget(ctx, pr.target, created)
		}
		return fmt.Errorf("bind mount %s at %s: %w", dir.Name(), pr.target, err)
	}

	// Belt and braces: the target must now show exactly the directory we opened, read-only
	// if asked. Anything else is undone rather than handed to a pod.
	var tst unix.Stat_t
	verr := scope.call(ctx, "stat "+pr.target, func() error { return unix.Stat(pr.target, &tst) })
	if verr == nil && (tst.Dev != src.Dev || tst.Ino != src.Ino) {
		verr = fmt.Errorf("%s shows a different directory than %s after the bind mount", pr.target, dir.Name())
	}
	if verr == nil && pr.readonly {
		mps, err := d.mountsAt(pr.target)
		switch {
		case err != nil:
			verr = err
		case len(mps) == 0 || !isReadOnly(mps[len(mps)-1]):
			verr = fmt.Errorf("%s is not read-only after the bind mount", pr.target)
		}
	}
	if verr != nil {
		if err := d.unmountAll(ctx, scope, pr.target); err != nil {
			logger.Error(err, "Failed to undo a bad bind mount", "target", pr.target)
		}
		return fmt.Errorf("verify bind mount: %w", verr)
	}
	logger.V(2).Info("Published local volume", "source", dir.Name(), "readonly", pr.readonly)
	return nil
}

func (d *Driver) publishNFS(ctx context.Context, scope *opScope, pr *publishRequest) error {
	logger := klog.FromContext(ctx)
	source := pr.attrs.NFSSource()
	existing, err := d.mountsAt(pr.target)
	if err != nil {
		return err
	}
	if len(existing) > 0 {
		top := existing[len(existing)-1]
		if top.Device == source && isReadOnly(top) == pr.readonly {
			logger.V(2).Info("Volume already published at target")
			return nil
		}
		return status.Errorf(codes.AlreadyExists, "%s is already mounted, but not with %s (read-only %t)", pr.target, source, pr.readonly)
	}
	if pr.mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		others, err := d.mountsOfSource(source)
		if err != nil {
			return err
		}
		if len(others) > 0 {
			return status.Errorf(codes.FailedPrecondition, "access mode SINGLE_NODE_SINGLE_WRITER: volume is already published at %v", others)
		}
	}
	created, err := makeTarget(pr.target)
	if err != nil {
		return err
	}
	opts := slices.Clone(pr.flags)
	if pr.readonly { // last, so that a PV's "rw" cannot override it
		opts = append(opts, "ro")
	}
	err = scope.call(ctx, "NFS mount of "+source+" at "+pr.target, func() error {
		return d.mounter.Mount(source, pr.target, "nfs", opts)
	})
	if err != nil {
		if !isTimeout(err) {
			d.removeUnmountedTarget(ctx, pr.target, created)
		}
		return fmt.Errorf("mount %s at %s: %w", source, pr.target, err)
	}
	logger.V(2).Info("Published NFS volume", "source", source, "options", opts)
	return nil
}

// makeTarget creates the target directory (kubelet creates only its parent) and reports
// whether it did.
func makeTarget(target string) (bool, error) {
	err := os.Mkdir(target, 0o750)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, os.ErrExist):
		fi, serr := os.Lstat(target)
		if serr != nil {
			return false, fmt.Errorf("check target %s: %w", target, serr)
		}
		if !fi.IsDir() {
			return false, status.Errorf(codes.FailedPrecondition, "target %s exists and is not a directory", target)
		}
		return false, nil
	case errors.Is(err, os.ErrNotExist):
		return false, status.Errorf(codes.FailedPrecondition, "parent of target %s does not exist", target)
	}
	return false, fmt.Errorf("create target %s: %w", target, err)
}

// removeUnmountedTarget undoes makeTarget after a failed mount, unless something is mounted
// there after all.
func (d *Driver) removeUnmountedTarget(ctx context.Context, target string, created bool) {
	if !created {
		return
	}
	if mps, err := d.mountsAt(target); err != nil || len(mps) > 0 {
		return
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		klog.FromContext(ctx).Error(err, "Failed to remove target after failed mount", "target", target)
	}
}

// NodeUnpublishVolume unmounts the target and removes it. A missing or unmounted target is
// success, so that kubelet's retries and calls after a crash converge.
func (s *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	target, err := checkAbsPath("target path", req.GetTargetPath())
	if err != nil {
		return nil, err
	}
	scope, err := s.d.locks.lock(ctx, lockKey(req.GetVolumeId(), target), s.d.opts.OperationTimeout)
	if err != nil {
		return nil, toStatus(err)
	}
	defer scope.release()
	if err := s.d.unmountAll(ctx, scope, target); err != nil {
		return nil, toStatus(err)
	}
	// rmdir, not RemoveAll: a target that is not empty once unmounted holds data that someone
	// wrote into the bare directory, and deleting it is not our call.
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "remove target %s after unmount: %v", target, err)
	}
	s.d.published.remove(req.GetVolumeId(), target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeGetInfo reports the node ID and the topology segment local volumes are pinned to.
func (s *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             s.d.opts.NodeID,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: s.d.opts.NodeID}},
	}, nil
}

// NodeGetCapabilities: no STAGE_UNSTAGE_VOLUME (a directory needs no per-node staging) and no
// EXPAND_VOLUME (directories have no size to grow).
func (s *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

// NodeStageVolume is not offered (no STAGE_UNSTAGE_VOLUME capability).
func (s *nodeServer) NodeStageVolume(context.Context, *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	return nil, status.Error(codes.Unimplemented, "NodeStageVolume is not supported: dirpv volumes need no staging")
}

// NodeUnstageVolume is not offered (no STAGE_UNSTAGE_VOLUME capability).
func (s *nodeServer) NodeUnstageVolume(context.Context, *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	return nil, status.Error(codes.Unimplemented, "NodeUnstageVolume is not supported: dirpv volumes need no staging")
}

// NodeExpandVolume is not offered (no EXPAND_VOLUME capability).
func (s *nodeServer) NodeExpandVolume(context.Context, *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	return nil, status.Error(codes.Unimplemented, "NodeExpandVolume is not supported: dirpv volumes are directories without a size")
}

// toStatus maps an internal error to the gRPC status the CSI spec asks for.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if st, ok := status.FromError(err); ok {
		return st.Err() // keeps the code of a wrapped status, with the whole message
	}
	var te *timeoutError
	switch {
	case errors.Is(err, errOperationPending):
		return status.Error(codes.Aborted, err.Error())
	case errors.As(err, &te) && errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.As(err, &te):
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, volume.ErrNotDirectory):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, os.ErrNotExist):
		return status.Error(codes.NotFound, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}
