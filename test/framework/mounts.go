package framework

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"
)

// MountInfosUnder lists the mounts at or below dir in this host's mount table (the tests share
// the mount namespace of dirpv and kubelet), deepest mount point first. Mounts stacked on one
// directory are listed once each.
func MountInfosUnder(dir string) ([]mount.MountInfo, error) {
	infos, err := mount.ParseMountInfo("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	var out []mount.MountInfo
	for _, mi := range infos {
		if mi.MountPoint == dir || strings.HasPrefix(mi.MountPoint, dir+"/") {
			out = append(out, mi)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].MountPoint > out[j].MountPoint })
	return out, nil
}

// MountsUnder lists the mount points at or below dir, deepest first.
func MountsUnder(dir string) ([]string, error) {
	infos, err := MountInfosUnder(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, mi := range infos {
		out = append(out, mi.MountPoint)
	}
	return out, nil
}

// WaitForNoMountsUnder waits until nothing is mounted at or below dir, e.g. after kubelet,
// which unpublishes asynchronously once the pod object is gone.
func WaitForNoMountsUnder(ctx context.Context, dir string, timeout time.Duration) error {
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		m, err := MountsUnder(dir)
		if err != nil {
			return false, err
		}
		return len(m) == 0, fmt.Errorf("still mounted: %v", m)
	})
	if err != nil {
		return fmt.Errorf("wait for no mounts under %s: %w", dir, err)
	}
	return nil
}

// DetachMountsUnder lazily unmounts everything at or below dir: what a killed dirpv left behind.
func DetachMountsUnder(dir string) {
	mounts, _ := MountsUnder(dir)
	for _, m := range mounts {
		unix.Unmount(m, unix.MNT_DETACH)
	}
}
