package node

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/dirpv/dirpv/test/vm/guest"
)

// The guest's quota-enforcing disks (Options.Disks): each a file system on a sparse loop file
// of the guest's own, mounted with project quota beneath deploy/'s allowed base
// (--allowed-base-paths=/var/lib/dirpv), so classes with `capacityEnforcement: required` can use
// them as their basePath.
const (
	// XFSBase is an XFS file system mounted with prjquota.
	XFSBase = "/var/lib/dirpv/xfs"
	// Ext4Base is an ext4 file system made with -O quota,project, mounted with prjquota.
	Ext4Base = "/var/lib/dirpv/ext4"
	// The disks' sizes: the quota tests need little; the XFS disk also holds the External
	// Storage suite's claim restored into 1Gi more than its source's size
	// (TestExternalStorageLocalXFSOnGuestNode). Sparse files: only what is written costs.
	ext4Size, xfsSize = 320 << 20, 2 << 30
)

// Disk is one of the guest's disks: its file system type and its mount point.
type Disk struct{ FSType, Base string }

// Disks are what Options.Disks mounts in the guest.
var Disks = []Disk{{"xfs", XFSBase}, {"ext4", Ext4Base}}

// setupDisks makes and mounts Disks, their images in dir (the agent's tmpfs: sparse, so only
// what the tests write takes the guest's memory), before kubelet starts, so dirpv's node
// plugin finds them whatever its base volume's mount propagation. The returned function
// unmounts them and detaches their loop devices.
func setupDisks(dir string) (unmount func() error, err error) {
	var mounted []string
	unmount = func() error {
		var errs []string
		for _, m := range mounted {
			if out, err := exec.Command("umount", "-d", m).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Sprintf("umount %s: %v: %s", m, err, strings.TrimSpace(string(out))))
			}
		}
		if len(errs) > 0 {
			return fmt.Errorf("%s", strings.Join(errs, "; "))
		}
		return nil
	}
	defer func() {
		if err != nil {
			unmount()
		}
	}()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	for _, d := range Disks {
		size := int64(xfsSize)
		if d.FSType == "ext4" {
			size = ext4Size
		}
		if err := guest.MakeFS(filepath.Join(dir, d.FSType+".img"), d.Base, d.FSType, size, "loop,prjquota"); err != nil {
			return nil, err
		}
		mounted = append(mounted, d.Base)
	}
	return unmount, nil
}
