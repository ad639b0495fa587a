package csinode

import (
	"context"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// TestVolumeStatsOfLimitedVolume: on a btrfs base with quota, an empty 20 MiB volume reports
// its own size, not the file system's, and next to nothing used; a volume without a limit
// reports the file system's figures. That a volume a pod half filled reports the pod's usage,
// test/e2e/install's TestKubeletReportsClaimUsage shows through kubelet.
func TestVolumeStatsOfLimitedVolume(t *testing.T) {
	ctx := context.Background()
	base := quotatest.Btrfs(t, true)
	root, err := volume.OpenRoot(base)
	must(t, err)
	defer root.Close()
	const limit = 20 << 20
	owner := volume.Owner{Mode: 0o777, UID: -1, GID: -1}
	_, ns := newTestDriver(t, mount.New(""), 10*time.Second)
	rw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	publish := func(name string, limited bool) string {
		t.Helper()
		attrs := volume.Attributes{Backend: volume.BackendLocal, BasePath: base, Path: name}
		claim := volume.Claim{UID: "uid-" + name, PVName: "pv-" + name}
		if limited {
			_, id, err := root.MkdirAllLimited(name, owner, claim, limit)
			must(t, err)
			attrs.Quota = id.String()
		} else if _, err := root.MkdirAll(name, owner, claim); err != nil {
			t.Fatal(err)
		}
		target := newTarget(t)
		publish(t, ns, publishReq(name, target, attrs, rw, false))
		t.Cleanup(func() {
			ns.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: name, TargetPath: target})
		})
		return target
	}
	empty, unlimited := publish("empty", true), publish("unlimited", false)

	stats := func(id, target string) (bytes, inodes *csi.VolumeUsage) {
		t.Helper()
		st, err := ns.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
		must(t, err)
		for _, u := range st.GetUsage() {
			switch u.GetUnit() {
			case csi.VolumeUsage_BYTES:
				bytes = u
			case csi.VolumeUsage_INODES:
				inodes = u
			}
		}
		if bytes == nil || inodes == nil {
			t.Fatalf("stats of %s: %v, want bytes and inodes", id, st.GetUsage())
		}
		return bytes, inodes
	}
	b, _ := stats("empty", empty)
	if b.GetTotal() != limit || b.GetUsed() > 64<<10 || b.GetAvailable() != limit-b.GetUsed() {
		t.Errorf("empty 20 MiB volume: %v; want total %d, next to nothing used, available the rest", b, limit)
	}
	var sfs unix.Statfs_t
	must(t, unix.Statfs(base, &sfs))
	b, _ = stats("unlimited", unlimited)
	if fsTotal := int64(sfs.Blocks) * sfs.Bsize; b.GetTotal() != fsTotal {
		t.Errorf("volume without a limit: total %d, want the file system's %d", b.GetTotal(), fsTotal)
	}
}
