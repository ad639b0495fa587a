// Command tenant does in a busybox pod what a tenant could do to escape its volume's quota
// with tools busybox lacks: change a file's project ID on XFS or ext4 (`chattr -p`, for
// TestQuotaEscapesOnGuestDisk) and create a btrfs subvolume (`btrfs subvolume create`, for
// TestPodNestedSubvolumeIsReported). It is built static (framework.BuildTenantTool).
//
//	tenant get FILE          print FILE's project ID
//	tenant set FILE ID       move FILE into project ID; print "ok" (read back at once through
//	                         the same descriptor, before a quota check can move it back) or
//	                         the error
//	tenant userns set FILE ID  the same from a new user namespace where the caller is root
//	                         (as `unshare -U -r` would do)
//	tenant subvolume DIR/NAME  create the btrfs subvolume NAME in DIR; print "ok" or the error
package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) >= 1 && args[0] == "userns" {
		// The caller's own UID and GID become root in the new namespace, which is all an
		// unprivileged process can map.
		cmd := exec.Command("/proc/self/exe", args[1:]...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{
			Cloneflags:  syscall.CLONE_NEWUSER,
			UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
			GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
		}
		if err := cmd.Run(); err != nil {
			if _, ok := err.(*exec.ExitError); ok {
				os.Exit(1) // the child printed why
			}
			return fmt.Errorf("new user namespace: %w", err)
		}
		return nil
	}
	if len(args) < 2 {
		return errUsage
	}
	if args[0] == "subvolume" && len(args) == 2 {
		return subvolume(args[1])
	}
	fd, err := unix.Open(args[1], unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", args[1], err)
	}
	defer unix.Close(fd)
	switch {
	case args[0] == "get" && len(args) == 2:
		id, err := quota.FileProject(fd)
		if err != nil {
			return err
		}
		fmt.Println(id)
		return nil
	case args[0] == "set" && len(args) == 3:
		id, err := strconv.ParseUint(args[2], 10, 32)
		if err != nil {
			return fmt.Errorf("project ID %q: %w", args[2], err)
		}
		if err := quota.SetFileProject(fd, uint32(id)); err != nil {
			return err
		}
		if got, err := quota.FileProject(fd); err != nil || got != uint32(id) {
			return fmt.Errorf("set project %d, read back %d (%v)", id, got, err)
		}
		fmt.Println("ok")
		return nil
	}
	return errUsage
}

var errUsage = errors.New("usage: tenant get FILE | tenant [userns] set FILE ID | tenant subvolume DIR/NAME")

// subvolume creates the subvolume at path as `btrfs subvolume create` does: the ioctl on its
// parent directory.
func subvolume(path string) error {
	dir, name := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	if err := quota.CreateSubvolume(fd, name); err != nil {
		return fmt.Errorf("create subvolume %s: %w", path, err)
	}
	fmt.Println("ok")
	return nil
}
