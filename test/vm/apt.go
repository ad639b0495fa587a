package vm

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
)

// hostPackages are the Debian packages the VM tier needs on the host: qemu and the initramfs
// tools, and everything the guest runs from the host's root (the NFS client and kernel server
// user space, nfs4_setfacl for the ACLs of the copy tests, and the file system and quota tools
// of the quota tests).
var hostPackages = []string{
	"qemu-system-x86", "busybox-static", "kmod",
	"nfs-kernel-server", "nfs-common", "rpcbind", "nfs4-acl-tools",
	"xfsprogs", "e2fsprogs", "quota", "btrfs-progs",
}

// aptLock makes apt wait for a dpkg lock held by a parallel installer instead of failing.
const aptLock = "-oDPkg::Lock::Timeout=600"

// ensurePackages installs whichever of pkgs are missing, after one apt-get update, since a
// fresh machine has no package lists.
func ensurePackages(ctx context.Context, progress io.Writer, pkgs []string) error {
	var missing []string
	for _, p := range pkgs {
		out, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f=${Status}", p).Output()
		if err != nil || !strings.Contains(string(out), "install ok installed") {
			missing = append(missing, p)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	fmt.Fprintf(progress, "dirpv-vm: installing host packages %v\n", missing)
	if err := aptGet(ctx, "", "update"); err != nil {
		return err
	}
	return aptGet(ctx, "", append([]string{"install", "-y", "--no-install-recommends"}, missing...)...)
}

// aptGet runs apt-get non-interactively in dir ("" for the current directory).
func aptGet(ctx context.Context, dir string, args ...string) error {
	cmd := exec.CommandContext(ctx, "apt-get", append([]string{aptLock}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}
