// Package exporttest holds test helpers for code that mounts NFS exports: a mounter that
// stands in for mount(8) and an NFS server with real bind mounts.
package exporttest

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// BindMounter stands in for mount(8) and an NFS server with real mounts: mounting
// "server:share" bind-mounts the local directory registered for it. Its Unmount can be made
// to hang, like umount(8) against a dead server.
type BindMounter struct {
	mount.Interface
	// Mounts counts the mounts made.
	Mounts atomic.Int32

	mu      sync.Mutex
	dirs    map[string]string        // source -> local directory
	targets map[string]string        // mount point -> source
	hang    map[string]chan struct{} // source -> Unmount waits until it is closed
}

// NewBindMounter returns a BindMounter that has no exports yet; the test's cleanup unmounts
// whatever it mounted.
func NewBindMounter(t *testing.T) *BindMounter {
	m := &BindMounter{Interface: mount.New(""), dirs: map[string]string{}, targets: map[string]string{}, hang: map[string]chan struct{}{}}
	t.Cleanup(func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		for _, ch := range m.hang {
			close(ch)
		}
		m.hang = map[string]chan struct{}{}
		for target := range m.targets {
			for IsMounted(target) {
				if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
					t.Errorf("clean up mount at %s: %v", target, err)
					break
				}
			}
		}
	})
	return m
}

// Export registers a fresh local directory as server:share and returns it.
func (m *BindMounter) Export(t *testing.T, server, share string) string {
	dir := t.TempDir()
	m.mu.Lock()
	m.dirs[volume.ExportSource(server, share)] = dir
	m.mu.Unlock()
	return dir
}

// HangUnmounts makes every later Unmount of a live mount of source wait until the test ends.
func (m *BindMounter) HangUnmounts(server, share string) {
	m.mu.Lock()
	m.hang[volume.ExportSource(server, share)] = make(chan struct{})
	m.mu.Unlock()
}

// Mount bind-mounts the directory registered for source on target.
func (m *BindMounter) Mount(source, target, _ string, _ []string) error {
	m.mu.Lock()
	dir, ok := m.dirs[source]
	m.targets[target] = source
	m.mu.Unlock()
	if !ok {
		return fmt.Errorf("no such export %s", source)
	}
	m.Mounts.Add(1)
	// The syscall, not mount(8): a fork and exec on a loaded machine can outlast the short
	// operation timeouts these tests use, and a slow mount would read as a dead server.
	if err := unix.Mount(dir, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", dir, target, err)
	}
	return nil
}

// Unmount unmounts target, first waiting as HangUnmounts asked.
func (m *BindMounter) Unmount(target string) error {
	m.mu.Lock()
	hang := m.hang[m.targets[target]]
	m.mu.Unlock()
	if hang != nil && IsMounted(target) {
		<-hang
	}
	if err := unix.Unmount(target, 0); err != nil {
		return fmt.Errorf("unmount %s: %w", target, err)
	}
	return nil
}

// IsMounted reports whether the kernel has a mount at dir.
func IsMounted(dir string) bool {
	infos, _ := mount.ParseMountInfo("/proc/self/mountinfo")
	return slices.ContainsFunc(infos, func(mi mount.MountInfo) bool { return mi.MountPoint == dir })
}

// Eventually polls cond until it holds or within has passed, and fails with cond's message.
func Eventually(t *testing.T, within time.Duration, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, msg := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", within, msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
