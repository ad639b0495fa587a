// Command projid reads and changes the project ID of a file on XFS or ext4 as a pod's process
// would (`chattr -p` without e2fsprogs), for the VM node tier's quota escape tests
// (TestQuotaEscapesOnGuestDisk). It is built static (CGO_ENABLED=0) to run in a busybox pod.
//
//	projid get FILE          print FILE's project ID
//	projid set FILE ID       move FILE into project ID; print "ok" (read back at once through
//	                         the same descriptor, before a quota check can move it back) or
//	                         the error
//	projid userns set FILE ID  the same from a new user namespace where the caller is root
//	                         (as `unshare -U -r` would do)
package main

import (
	"fmt"
	"os"
	"os/exec"
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
		return fmt.Errorf("usage: projid get FILE | projid [userns] set FILE ID")
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
	return fmt.Errorf("usage: projid get FILE | projid [userns] set FILE ID")
}
