// Package quotatest makes real file systems with quotas on for tests: a btrfs file system on
// a loop device of the test's own, with quota enabled. Everything it makes is removed when
// the test ends, the loop device included (only that one).
package quotatest

import (
	"errors"
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
	if os.Geteuid() != 0 {
		t.Fatal("quotatest.Btrfs needs root (loop devices and mount)")
	}
	dir := t.TempDir()
	img := filepath.Join(dir, "btrfs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 256<<20); err != nil {
		t.Fatal(err)
	}
	dev := strings.TrimSpace(run(t, "losetup", "-f", "--show", img))
	t.Cleanup(func() { run(t, "losetup", "-d", dev) })
	run(t, "mkfs.btrfs", "-q", "-f", dev)
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dev, mnt, "btrfs", 0, ""); err != nil {
		t.Fatalf("mount %s on %s: %v", dev, mnt, err)
	}
	t.Cleanup(func() {
		// Code under test may close its descriptors on the file system just after the test
		// (a provisioner's Run returning): wait for that, within a deadline.
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := unix.Unmount(mnt, 0)
			if err == nil {
				return
			}
			if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
				t.Errorf("unmount %s: %v", mnt, err)
				unix.Unmount(mnt, unix.MNT_DETACH) // so the loop device can still go
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	if quota {
		run(t, "btrfs", "quota", "enable", mnt)
	}
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

func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
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
