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
	return timed(iters, func() error {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		_, err := node.NodePublishVolume(cctx, &csi.NodePublishVolumeRequest{
			VolumeId: volumeID, TargetPath: target, VolumeCapability: capability, VolumeContext: attrs,
		})
		if err == nil {
			_, err = node.NodeUnpublishVolume(cctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volumeID, TargetPath: target})
		}
		if err != nil {
			return fmt.Errorf("publish/unpublish: %w", err)
		}
		return nil
	})
}

// timed runs fn iters times after one unmeasured run and returns each measured run's time.
func timed(iters int, fn func() error) ([]time.Duration, error) {
	var out []time.Duration
	for i := -1; i < iters; i++ {
		t0 := time.Now()
		if err := fn(); err != nil {
			return nil, err
		}
		if i >= 0 {
			out = append(out, time.Since(t0))
		}
	}
	return out, nil
}

// bareBind times mkdir target, mount (a bind mount of src), unmount, rmdir.
func bareBind(target string, iters int, mount func(target string) error, unmount func(target string) error) ([]time.Duration, error) {
	return timed(iters, func() error {
		if err := os.Mkdir(target, 0o750); err != nil {
			return err
		}
		if err := mount(target); err != nil {
			return fmt.Errorf("bind mount: %w", err)
		}
		if err := unmount(target); err != nil {
			return fmt.Errorf("unmount: %w", err)
		}
		return os.Remove(target)
	})
}

// bareBindSyscall is the floor: mkdir target, mount(2) MS_BIND, umount(2), rmdir.
func bareBindSyscall(src, targetParent string, iters int) ([]time.Duration, error) {
	return bareBind(filepath.Join(targetParent, "bare-syscall"), iters,
		func(target string) error { return unix.Mount(src, target, "", unix.MS_BIND, "") },
		func(target string) error { return unix.Unmount(target, 0) })
}

// bareBindMountUtils is what kubelet and most CSI drivers do: mkdir, mount-utils' Mount with
// "bind" (runs mount(8)), Unmount (runs umount(8)), rmdir.
func bareBindMountUtils(src, targetParent string, iters int) ([]time.Duration, error) {
	m := mount.New("")
	return bareBind(filepath.Join(targetParent, "bare-mount-utils"), iters,
		func(target string) error { return m.Mount(src, target, "", []string{"bind"}) },
		m.Unmount)
}
