package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/mount-utils"
)

// publishBench times NodePublishVolume + NodeUnpublishVolume of a local volume through the
// node plugin's real CSI socket, as kubelet calls them, iters times.
func publishBench(ctx context.Context, socket, volumeID string, attrs map[string]string, targetParent string, iters int) ([]time.Duration, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("dial CSI socket %s: %w", socket, err)
	}
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	target := filepath.Join(targetParent, "csi-target")
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	// One unmeasured round trip: gRPC connection set-up is not per call.
	var out []time.Duration
	for i := -1; i < iters; i++ {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		t0 := time.Now()
		_, err := node.NodePublishVolume(cctx, &csi.NodePublishVolumeRequest{
			VolumeId: volumeID, TargetPath: target, VolumeCapability: capability, VolumeContext: attrs,
		})
		if err == nil {
			_, err = node.NodeUnpublishVolume(cctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volumeID, TargetPath: target})
		}
		d := time.Since(t0)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("publish/unpublish %d: %w", i, err)
		}
		if i >= 0 {
			out = append(out, d)
		}
	}
	return out, nil
}

// bareBindSyscall is the floor: mkdir target, mount(2) MS_BIND, umount(2), rmdir.
func bareBindSyscall(src, targetParent string, iters int) ([]time.Duration, error) {
	target := filepath.Join(targetParent, "bare-syscall")
	var out []time.Duration
	for i := -1; i < iters; i++ {
		t0 := time.Now()
		if err := os.Mkdir(target, 0o750); err != nil {
			return nil, err
		}
		if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
			return nil, fmt.Errorf("bind mount: %w", err)
		}
		if err := unix.Unmount(target, 0); err != nil {
			return nil, fmt.Errorf("unmount: %w", err)
		}
		if err := os.Remove(target); err != nil {
			return nil, err
		}
		if i >= 0 {
			out = append(out, time.Since(t0))
		}
	}
	return out, nil
}

// bareBindMountUtils is what kubelet and most CSI drivers do: mkdir, mount-utils' Mount with
// "bind" (runs mount(8)), Unmount (runs umount(8)), rmdir.
func bareBindMountUtils(src, targetParent string, iters int) ([]time.Duration, error) {
	target := filepath.Join(targetParent, "bare-mount-utils")
	m := mount.New("")
	var out []time.Duration
	for i := -1; i < iters; i++ {
		t0 := time.Now()
		if err := os.Mkdir(target, 0o750); err != nil {
			return nil, err
		}
		if err := m.Mount(src, target, "", []string{"bind"}); err != nil {
			return nil, fmt.Errorf("bind mount: %w", err)
		}
		if err := m.Unmount(target); err != nil {
			return nil, fmt.Errorf("unmount: %w", err)
		}
		if err := os.Remove(target); err != nil {
			return nil, err
		}
		if i >= 0 {
			out = append(out, time.Since(t0))
		}
	}
	return out, nil
}
