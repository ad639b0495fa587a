// Package quotatest makes real file systems with quotas on for tests: a btrfs file system on
// a loop device of the test's own, with quota enabled. Everything it makes is removed when
// the test ends, the loop device included (only that one).
package quotatest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Btrfs mounts a new 256 MiB btrfs file system, with quota enabled if quota is true, and
// returns its mount point. It needs root, losetup, mkfs.btrfs and btrfs; without them the test
// fails rather than skips, so that a machine that cannot run it is noticed.
func Btrfs(t testing.TB, quota bool) string {
	t.Helper()
	return BtrfsOfSize(t, 256<<20, quota)
}

// BtrfsOfSize is Btrfs with a file system of size bytes (its image file is sparse).
func BtrfsOfSize(t testing.TB, size int64, quota bool) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("quotatest.Btrfs needs root (loop devices and mount)")
	}
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	fs, err := MountBtrfs(filepath.Join(dir, "btrfs.img"), mnt, size, quota)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := fs.Remove(); err != nil {
			t.Error(err)
		}
	})
	return mnt
}

// Qgroups lists the level-0 qgroups of the btrfs file system at mnt, as `btrfs qgroup show`
// reports them after the subvolumes deleted so far are gone (`btrfs subvolume sync`: the
// kernel drops a deleted subvolume, and then its qgroup, in the background), each with its
// referenced-bytes limit ("none" if it has none).
func Qgroups(t testing.TB, mnt string) map[string]string {
	t.Helper()
	// A commit first wakes the cleaner, which otherwise waits for the next periodic commit
	// (30 s).
	run(t, "btrfs", "filesystem", "sync", mnt)
	run(t, "timeout", "60", "btrfs", "subvolume", "sync", mnt)
	// The qgroup of a dropped subvolume goes in a later commit.
	run(t, "btrfs", "filesystem", "sync", mnt)
	out := run(t, "btrfs", "qgroup", "show", "-r", "--raw", mnt)
	groups := map[string]string{}
	for _, line := range strings.Split(out, "\n") {
		// qgroupid rfer excl max_rfer path
		if f := strings.Fields(line); len(f) >= 4 && strings.HasPrefix(f[0], "0/") {
			groups[f[0]] = f[3]
		}
	}
	return groups
}

// run is command for a test, which it fails on error.
func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := command(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// BtrfsFS is a file system on a loop device made by MountBtrfs (or XFS, MountExt4).
type BtrfsFS struct {
	// Mnt is where it is mounted.
	Mnt string
	dev string
}

// MountBtrfs makes a btrfs file system of size bytes in the new image file img, on a loop
// device of its own, mounts it at mnt (made if missing) and, if quota is true, enables quota.
// It is Btrfs for what outlives one test (a suite's fixture); on error nothing is left.
func MountBtrfs(img, mnt string, size int64, quota bool) (_ *BtrfsFS, err error) {
	fs, err := mountLoop(img, mnt, size, "btrfs", "mkfs.btrfs", "-q", "-f")
	if err != nil || !quota {
		return fs, err
	}
	if _, err := command("btrfs", "quota", "enable", mnt); err != nil {
		fs.Remove()
		return nil, err
	}
	return fs, nil
}

// MountExt4 makes an ext4 file system of size bytes, with mkfs.ext4's defaults (a journal:
// ext4 as users have it), in the new image file img on a loop device of its own and mounts it
// at mnt (made if missing). On error nothing is left.
func MountExt4(img, mnt string, size int64) (*BtrfsFS, error) {
	return mountLoop(img, mnt, size, "ext4", "mkfs.ext4", "-q", "-F")
}

// XFS mounts a new 320 MiB XFS file system (xfsprogs' smallest is 300 MiB; its image file is
// sparse) without quota options, and returns its mount point: project IDs are kept and can be
// read and set whether or not the kernel enforces project quotas. It needs what Btrfs needs,
// mkfs.xfs for mkfs.btrfs.
func XFS(t testing.TB) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("quotatest.XFS needs root (loop devices and mount)")
	}
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	fs, err := mountLoop(filepath.Join(dir, "xfs.img"), mnt, 320<<20, "xfs", "mkfs.xfs", "-q", "-f")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := fs.Remove(); err != nil {
			t.Error(err)
		}
	})
	return mnt
}

// mountLoop makes a file system of type fstype and size bytes with the mkfs command line in
// the new image file img, on a loop device of its own, and mounts it at mnt (made if
// missing). On error nothing is left.
func mountLoop(img, mnt string, size int64, fstype string, mkfs ...string) (_ *BtrfsFS, err error) {
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			os.Remove(img)
		}
	}()
	if err := os.Truncate(img, size); err != nil {
		return nil, err
	}
	out, err := command("losetup", "-f", "--show", img)
	if err != nil {
		return nil, err
	}
	fs := &BtrfsFS{Mnt: mnt, dev: strings.TrimSpace(out)}
	defer func() {
		if err != nil {
			command("losetup", "-d", fs.dev)
		}
	}()
	if _, err := command(mkfs[0], append(mkfs[1:], fs.dev)...); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return nil, err
	}
	if err := unix.Mount(fs.dev, mnt, fstype, 0, ""); err != nil {
		return nil, fmt.Errorf("mount %s on %s: %w", fs.dev, mnt, err)
	}
	return fs, nil
}

// Remove unmounts the file system and detaches its loop device (only that one); the image
// file is left to whoever owns its directory.
func (fs *BtrfsFS) Remove() error {
	// Code under test may close its descriptors on the file system just after a test (a
	// provisioner's Run returning): wait for that, within a deadline.
	deadline := time.Now().Add(10 * time.Second)
	var uerr error
	for {
		err := unix.Unmount(fs.Mnt, 0)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			uerr = fmt.Errorf("unmount %s: %w", fs.Mnt, err)
			unix.Unmount(fs.Mnt, unix.MNT_DETACH) // so the loop device can still go
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	_, err := command("losetup", "-d", fs.dev)
	return errors.Join(uerr, err)
}

// Detach unmounts the file system lazily and detaches its loop device (which the kernel frees
// once the last user lets go): for a disk that a running process holds open, as dirpv's node
// plugin holds its bases.
func (fs *BtrfsFS) Detach() error {
	if err := unix.Unmount(fs.Mnt, unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount %s: %w", fs.Mnt, err)
	}
	_, err := command("losetup", "-d", fs.dev)
	return err
}

func command(name string, args ...string) (string, error) {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// Fill writes up to n bytes of data to a new file at p, syncing each MiB, and returns how much
// went in and the error that stopped it (EDQUOT or ENOSPC at a limit).
func Fill(t testing.TB, p string, n int) (int, error) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return WriteFull(f, n)
}

// WriteFull is Fill on a file the caller holds open, appending where f stands: a process that
// keeps its file open across a change of the limit.
func WriteFull(f *os.File, n int) (int, error) {
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i*7 + 3) // not zeros, so nothing compresses or is skipped
	}
	written := 0
	for written < n {
		m, err := f.Write(buf[:min(len(buf), n-written)])
		written += m
		if err == nil {
			err = f.Sync()
		}
		if err != nil {
			return written, err
		}
	}
	return written, f.Sync()
}
