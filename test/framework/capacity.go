package framework

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/kubernetes"
	statsapi "k8s.io/kubelet/pkg/apis/stats/v1alpha1"

	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// MountBtrfs mounts a new btrfs file system of size bytes at dir. With quota it is a base
// where local classes' sizes are enforced (a subvolume and a qgroup limit per volume).
// The image is in the workspace; the file system is unmounted and its loop device detached at
// Close, once what was started after it (the cluster, dirpv's pods) is stopped.
//
// A node plugin that runs as a pod sees only what was mounted beneath its base-path volume
// before it started when that volume has no mount propagation (deploy/overlays/e2e-local):
// call this before installing dirpv, e.g. from SuiteOptions.BeforeCluster.
func (s *Suite) MountBtrfs(dir string, size int64, quota bool) error {
	return s.mountLoop(dir, "btrfs", func(img string) (*quotatest.BtrfsFS, error) {
		return quotatest.MountBtrfs(img, dir, size, quota)
	})
}

// MountExt4 mounts a new ext4 file system of size bytes, made with mkfs.ext4's defaults, at
// dir; like MountBtrfs, until Close.
func (s *Suite) MountExt4(dir string, size int64) error {
	return s.mountLoop(dir, "ext4", func(img string) (*quotatest.BtrfsFS, error) {
		return quotatest.MountExt4(img, dir, size)
	})
}

// mountLoop mounts at dir the file system that mount makes in an image of the workspace, and
// removes it at Close.
func (s *Suite) mountLoop(dir, fstype string, mount func(img string) (*quotatest.BtrfsFS, error)) error {
	// A run killed before its cleanups left its file system here: do not stack on it.
	DetachMountsUnder(dir)
	fs, err := mount(filepath.Join(s.Work.Dir, fstype+"-"+filepath.Base(dir)+".img"))
	if err != nil {
		return fmt.Errorf("%s base at %s: %w", fstype, dir, err)
	}
	s.Cleanups.Add(func() {
		if err := fs.Remove(); err != nil {
			fmt.Fprintf(os.Stderr, "%s base at %s: %v\n", fstype, dir, err)
		}
	})
	return nil
}

// KubeletVolumeStats returns what kubelet reports for the claim ns/claim in its stats summary
// (/stats/summary, read through the API server as `kubectl get --raw` would): the figures it
// got from the CSI driver's NodeGetVolumeStats, the same as its kubelet_volume_stats_* metrics.
// It returns nil, and no error, while no pod on node has reported the claim yet.
func KubeletVolumeStats(ctx context.Context, c kubernetes.Interface, node, ns, claim string) (*statsapi.VolumeStats, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	raw, err := c.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes", node, "proxy", "stats", "summary").DoRaw(ctx)
	if err != nil {
		return nil, fmt.Errorf("stats summary of node %s: %w", node, err)
	}
	var sum statsapi.Summary
	if err := json.Unmarshal(raw, &sum); err != nil {
		return nil, fmt.Errorf("stats summary of node %s: %w", node, err)
	}
	for _, p := range sum.Pods {
		for _, v := range p.VolumeStats {
			if r := v.PVCRef; r != nil && r.Namespace == ns && r.Name == claim {
				return &v, nil
			}
		}
	}
	return nil, nil
}
