package nfs

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	mount "k8s.io/mount-utils"
)

// The tests need root (Ganesha, FUSE mounts) and are skipped otherwise.

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
}

func startServer(t *testing.T, opts Options) *Server {
	t.Helper()
	needRoot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute) // may apt-get install
	defer cancel()
	t0 := time.Now()
	s, err := Start(ctx, opts)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Logf("ganesha started in %s (nfs port %d, mount port %d)", time.Since(t0).Round(time.Millisecond), s.Port, s.MountPort)
	t.Cleanup(func() {
		t0 := time.Now()
		if err := s.Stop(); err != nil {
			t.Errorf("Stop: %v", err)
		}
		t.Logf("server stopped in %s", time.Since(t0).Round(time.Millisecond))
	})
	return s
}

func mountHelper(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	p, err := BuildMountHelper(ctx)
	if err != nil {
		t.Fatalf("BuildMountHelper: %v", err)
	}
	return p
}

// mountShare mounts src at a fresh target with mount-utils handed the
// helper, exactly as the provisioner and node plugin will in tests. The
// cleanup unmounts whatever is still mounted, lazily if need be.
func mountShare(t *testing.T, m mount.Interface, src string, opts []string) string {
	t.Helper()
	target := t.TempDir()
	t0 := time.Now()
	if err := m.Mount(src, target, "nfs", opts); err != nil {
		t.Fatalf("mount %s: %v", src, err)
	}
	t.Logf("mounted %s in %s", src, time.Since(t0).Round(time.Millisecond))
	t.Cleanup(func() { forceUnmount(t, target) })
	return target
}

func forceUnmount(t *testing.T, target string) {
	for range 10 { // stacked mounts, if a test made any
		if !isMounted(t, target) {
			return
		}
		if err := syscall.Unmount(target, 0); err != nil {
			_ = syscall.Unmount(target, syscall.MNT_DETACH)
		}
	}
}

// isMounted reads /proc/self/mountinfo: unlike a stat-based check it does not
// touch the (possibly stale) FUSE mount.
func isMounted(t *testing.T, target string) bool {
	t.Helper()
	mps, err := mount.ParseMountInfo("/proc/self/mountinfo")
	if err != nil {
		t.Fatalf("reading mountinfo: %v", err)
	}
	for _, mp := range mps {
		if mp.MountPoint == target {
			return true
		}
	}
	return false
}

func mountInfo(t *testing.T, target string) mount.MountInfo {
	t.Helper()
	mps, err := mount.ParseMountInfo("/proc/self/mountinfo")
	if err != nil {
		t.Fatalf("reading mountinfo: %v", err)
	}
	for _, mp := range mps {
		if mp.MountPoint == target {
			return mp
		}
	}
	t.Fatalf("%s is not mounted", target)
	return mount.MountInfo{}
}

// poll calls f until it returns nil or the deadline passes.
func poll(t *testing.T, d time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not done after %s: %v", what, d, err)
		}
		<-tick.C
	}
}

func randomBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func mkSub(t *testing.T, s *Server, sub string) string {
	t.Helper()
	d := filepath.Join(s.ExportDir, sub)
	if err := os.MkdirAll(d, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(d, 0o777); err != nil {
		t.Fatal(err)
	}
	return d
}

func TestMountReadWrite(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	serverDir := mkSub(t, s, "sub")
	opts := append([]string{"vers=3", "nolock", "hard", "timeo=600"}, s.MountOptions()...)
	target := mountShare(t, m, s.Source("sub"), opts)

	// mount-utils must see a mount point right after Mount returns.
	notMnt, err := m.IsLikelyNotMountPoint(target)
	if err != nil || notMnt {
		t.Fatalf("IsLikelyNotMountPoint(%s) = %v, %v; want a mount point", target, notMnt, err)
	}
	mi := mountInfo(t, target)
	if mi.Source != s.Source("sub") || mi.FsType != "fuse.nfs" {
		t.Errorf("mountinfo source %q type %q; want %q fuse.nfs", mi.Source, mi.FsType, s.Source("sub"))
	}
	rec, err := ReadMountRecord(target)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rec.Options, opts) || rec.Source != s.Source("sub") || rec.FSType != "nfs" || rec.ReadOnly {
		t.Errorf("mount record %+v; want options %v", rec, opts)
	}

	// Client -> server, 8 MiB, byte-identical.
	data := randomBytes(t, 8<<20)
	t0 := time.Now()
	if err := os.WriteFile(filepath.Join(target, "up.bin"), data, 0o640); err != nil {
		t.Fatalf("write through mount: %v", err)
	}
	wdur := time.Since(t0)
	got, err := os.ReadFile(filepath.Join(serverDir, "up.bin"))
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("server side content differs (err %v, %d bytes)", err, len(got))
	}
	// Server -> client.
	if err := os.WriteFile(filepath.Join(serverDir, "down.bin"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	got, err = os.ReadFile(filepath.Join(target, "down.bin"))
	rdur := time.Since(t0)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("client side content differs (err %v, %d bytes)", err, len(got))
	}
	t.Logf("8 MiB write %s (%.0f MB/s), read %s (%.0f MB/s)", wdur.Round(time.Millisecond),
		8.388608/wdur.Seconds(), rdur.Round(time.Millisecond), 8.388608/rdur.Seconds())

	// mkdir, chmod, chown, truncate, symlink, rename: visible server-side.
	if err := os.Mkdir(filepath.Join(target, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	// syscall.Chmod: os.Chmod drops a raw 0o2000 (it wants os.ModeSetgid).
	if err := syscall.Chmod(filepath.Join(target, "d"), 0o2751); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(filepath.Join(target, "d"), 1234, 5678); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(target, "up.bin"), 100); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../up.bin", filepath.Join(target, "d", "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(target, "down.bin"), filepath.Join(target, "d", "moved.bin")); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(serverDir, "d"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode&0o7777 != 0o2751 || st.Uid != 1234 || st.Gid != 5678 || st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		t.Errorf("server side d: mode %o uid %d gid %d; want dir 2751 1234:5678", st.Mode, st.Uid, st.Gid)
	}
	if fi, err := os.Stat(filepath.Join(serverDir, "up.bin")); err != nil || fi.Size() != 100 {
		t.Errorf("server side truncate: %v, %v", fi, err)
	}
	if l, err := os.Readlink(filepath.Join(serverDir, "d", "link")); err != nil || l != "../up.bin" {
		t.Errorf("server side symlink: %q, %v", l, err)
	}
	if l, err := os.Readlink(filepath.Join(target, "d", "link")); err != nil || l != "../up.bin" {
		t.Errorf("readlink through mount: %q, %v", l, err)
	}
	if _, err := os.Stat(filepath.Join(serverDir, "d", "moved.bin")); err != nil {
		t.Errorf("server side rename: %v", err)
	}
	ents, err := os.ReadDir(filepath.Join(target, "d"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{"link", "moved.bin"}) {
		t.Errorf("readdir through mount: %v", names)
	}

	// statfs works (the node plugin's volume stats need it).
	var sfs syscall.Statfs_t
	if err := syscall.Statfs(target, &sfs); err != nil || sfs.Blocks == 0 || sfs.Bsize == 0 {
		t.Errorf("statfs: %+v, %v", sfs, err)
	}

	// unlink, rmdir: gone server-side; and ENOTEMPTY / ENOENT come through.
	if err := os.Remove(filepath.Join(target, "d")); !errors.Is(err, syscall.ENOTEMPTY) && !errors.Is(err, syscall.EEXIST) {
		t.Errorf("rmdir of non-empty dir: %v; want ENOTEMPTY", err)
	}
	if _, err := os.Stat(filepath.Join(target, "nope")); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("stat missing: %v; want ENOENT", err)
	}
	for _, p := range []string{"d/link", "d/moved.bin", "d", "up.bin"} {
		if err := os.Remove(filepath.Join(target, p)); err != nil {
			t.Fatal(err)
		}
	}
	if ents, _ := os.ReadDir(serverDir); len(ents) != 0 {
		t.Errorf("server dir not empty after removals: %v", ents)
	}

	// Unmount the way mount-utils does; the mount, record and daemon go away.
	if err := m.Unmount(target); err != nil {
		t.Fatalf("Unmount: %v", err)
	}
	if isMounted(t, target) {
		t.Fatal("still mounted after Unmount")
	}
	if notMnt, err := m.IsLikelyNotMountPoint(target); err != nil || !notMnt {
		t.Errorf("IsLikelyNotMountPoint after unmount = %v, %v", notMnt, err)
	}
	poll(t, 10*time.Second, "daemon exit", func() error {
		if err := syscall.Kill(rec.PID, 0); err == nil && !isZombie(rec.PID) {
			return errors.New("daemon still running")
		}
		if _, err := os.Stat(MountRecordPath(target)); err == nil {
			return errors.New("mount record still present")
		}
		return nil
	})
}

// TestConcurrentIO drives many requests through one mount at once: the
// helper multiplexes them over one RPC connection.
func TestConcurrentIO(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	serverDir := mkSub(t, s, "c")
	target := mountShare(t, m, s.Source("c"), s.MountOptions())
	const n = 8
	want := make([][]byte, n)
	errs := make(chan error, n)
	for i := range n {
		want[i] = randomBytes(t, 1<<20+i*4093)
		go func() {
			p := filepath.Join(target, "f"+strconv.Itoa(i))
			if err := os.WriteFile(p, want[i], 0o644); err != nil {
				errs <- err
				return
			}
			got, err := os.ReadFile(p)
			if err == nil && !bytes.Equal(got, want[i]) {
				err = errors.New("read back differs: " + p)
			}
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	for i := range n {
		if got, err := os.ReadFile(filepath.Join(serverDir, "f"+strconv.Itoa(i))); err != nil || !bytes.Equal(got, want[i]) {
			t.Errorf("server side f%d differs: %v", i, err)
		}
	}
}

// isZombie: the daemon's parent exits right after mounting, so an exited
// daemon is reaped by PID 1, which in some containers never reaps.
func isZombie(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return true
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] == 'Z'
}

func TestMountMissingSubdirFails(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	target := t.TempDir()
	t.Cleanup(func() { forceUnmount(t, target) })
	err := m.Mount(s.Source("does/not/exist"), target, "nfs", s.MountOptions())
	if err == nil {
		t.Fatal("mount of a missing directory succeeded")
	}
	if !strings.Contains(err.Error(), "No such file or directory") {
		t.Errorf("error %q does not say No such file or directory", err)
	}
	if isMounted(t, target) {
		t.Error("target mounted after failed mount")
	}
}

func TestMountReadOnly(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	serverDir := mkSub(t, s, "ro")
	if err := os.WriteFile(filepath.Join(serverDir, "f"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	target := mountShare(t, m, s.Source("ro"), append([]string{"ro", "vers=3"}, s.MountOptions()...))
	if b, err := os.ReadFile(filepath.Join(target, "f")); err != nil || string(b) != "hello" {
		t.Fatalf("read through ro mount: %q, %v", b, err)
	}
	for name, f := range map[string]func() error{
		"create": func() error { return os.WriteFile(filepath.Join(target, "g"), nil, 0o644) },
		"write": func() error {
			return os.WriteFile(filepath.Join(target, "f"), []byte("x"), 0o644)
		},
		"mkdir":  func() error { return os.Mkdir(filepath.Join(target, "d"), 0o755) },
		"chmod":  func() error { return os.Chmod(filepath.Join(target, "f"), 0o600) },
		"unlink": func() error { return os.Remove(filepath.Join(target, "f")) },
	} {
		if err := f(); !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s on ro mount: %v; want EROFS", name, err)
		}
	}
	if rec, err := ReadMountRecord(target); err != nil || !rec.ReadOnly || !slices.Contains(rec.Options, "ro") {
		t.Errorf("mount record %+v, %v; want ro", rec, err)
	}
	if b, _ := os.ReadFile(filepath.Join(serverDir, "f")); string(b) != "hello" {
		t.Errorf("server file changed through ro mount: %q", b)
	}
}

// TestStaleMountUnmount: the server dies under a mount; I/O must fail with
// EIO within a bounded time and unmounting the stale mount must work.
func TestStaleMountUnmount(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	mkSub(t, s, "stale")
	target := mountShare(t, m, s.Source("stale"), s.MountOptions())
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	_, err := os.ReadFile(filepath.Join(target, "other"))
	if err == nil || time.Since(t0) > 20*time.Second {
		t.Errorf("I/O on a dead server: err %v after %s; want an error within 20s", err, time.Since(t0))
	}
	t.Logf("I/O on dead server failed after %s: %v", time.Since(t0).Round(time.Millisecond), err)

	t0 = time.Now()
	done := make(chan error, 1)
	go func() { done <- m.Unmount(target) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Unmount of stale mount: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Unmount of stale mount hung for 30s")
	}
	t.Logf("stale unmount took %s", time.Since(t0).Round(time.Millisecond))
	if isMounted(t, target) {
		t.Error("still mounted after Unmount")
	}
}

// TestHungServer: a paused (SIGSTOPped) server accepts connections but never
// answers; the per-RPC deadline must still turn I/O into EIO, and the stale
// mount must unmount.
func TestHungServer(t *testing.T) {
	// The daemon inherits the environment through mount-utils: a short NFS
	// deadline keeps this test fast.
	t.Setenv("DIRPV_NFS_FUSE_TIMEOUT", "2s")
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	mkSub(t, s, "hung")
	target := mountShare(t, m, s.Source("hung"), s.MountOptions())
	if err := s.Pause(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Unpause() })
	t0 := time.Now()
	_, err := os.Stat(filepath.Join(target, "nope"))
	if !errors.Is(err, syscall.EIO) || time.Since(t0) > 15*time.Second {
		t.Errorf("stat on a hung server: %v after %s; want EIO within 15s", err, time.Since(t0))
	}
	t.Logf("I/O on hung server failed after %s: %v", time.Since(t0).Round(time.Millisecond), err)
	t0 = time.Now()
	done := make(chan error, 1)
	go func() { done <- m.Unmount(target) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Unmount with a hung server: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Unmount with a hung server hung for 30s")
	}
	t.Logf("unmount with hung server took %s", time.Since(t0).Round(time.Millisecond))
	if isMounted(t, target) {
		t.Error("still mounted after Unmount")
	}
}

// TestServerRestartMidUse: the server goes away and comes back on the same
// port and export; an existing mount recovers (Ganesha VFS handles are
// persistent), and new mounts work.
func TestServerRestartMidUse(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	serverDir := mkSub(t, s, "r")
	target := mountShare(t, m, s.Source("r"), s.MountOptions())
	if err := os.WriteFile(filepath.Join(target, "before"), []byte("1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(target, "during"), []byte("2"), 0o644); err == nil {
		t.Error("write while the server is down succeeded")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t0 := time.Now()
	if err := s.Resume(ctx); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	t.Logf("resume took %s", time.Since(t0).Round(time.Millisecond))
	// The first operation after the restart meets a dead connection; the
	// helper redials and resends idempotent calls, so no EIO surfaces.
	if err := os.WriteFile(filepath.Join(target, "after"), []byte("3"), 0o644); err != nil {
		t.Fatalf("first write after resume: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(serverDir, "after")); err != nil || string(b) != "3" {
		t.Errorf("server side after resume: %q, %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(target, "before")); err != nil || string(b) != "1" {
		t.Errorf("old file through old mount: %q, %v", b, err)
	}
	// Graceful restart too.
	if err := s.Restart(ctx); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	target2 := mountShare(t, m, s.Source("r"), s.MountOptions())
	if b, err := os.ReadFile(filepath.Join(target2, "after")); err != nil || string(b) != "3" {
		t.Errorf("new mount after restart: %q, %v", b, err)
	}
}

// TestStopStartSameExportAndPort: a fully stopped server started again on the
// caller's export dir and the same ports serves an existing mount again.
func TestStopStartSameExportAndPort(t *testing.T) {
	export := t.TempDir()
	s1 := startServer(t, Options{ExportDir: export})
	m := mount.New(mountHelper(t))
	mkSub(t, s1, "keep")
	target := mountShare(t, m, s1.Source("keep"), s1.MountOptions())
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("one"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s1.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(export, "keep", "f")); err != nil {
		t.Fatalf("Stop removed the caller's export dir: %v", err)
	}
	s2 := startServer(t, Options{ExportDir: export, Port: s1.Port, MountPort: s1.MountPort})
	if s2.Port != s1.Port || s2.MountPort != s1.MountPort {
		t.Fatalf("ports changed: %d/%d -> %d/%d", s1.Port, s1.MountPort, s2.Port, s2.MountPort)
	}
	poll(t, 30*time.Second, "old mount serves again", func() error {
		b, err := os.ReadFile(filepath.Join(target, "f"))
		if err == nil && string(b) != "one" {
			return errors.New("wrong content " + string(b))
		}
		return err
	})
}

func TestRootSquash(t *testing.T) {
	s := startServer(t, Options{Squash: SquashRoot})
	m := mount.New(mountHelper(t))
	serverDir := mkSub(t, s, "sq")
	target := mountShare(t, m, s.Source("sq"), s.MountOptions())
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("x"), 0o644); err != nil {
		t.Fatalf("create as squashed root: %v", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(serverDir, "f"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 65534 {
		t.Errorf("file created by squashed root owned by %d; want 65534", st.Uid)
	}
	if err := os.Chown(filepath.Join(target, "f"), 1000, 1000); !errors.Is(err, syscall.EPERM) {
		t.Errorf("chown through root_squash mount: %v; want EPERM", err)
	}
}

// TestSupplementaryGroups: permissions granted through a supplementary
// group (how a pod's fsGroup works) hold through the mount.
func TestSupplementaryGroups(t *testing.T) {
	s := startServer(t, Options{})
	m := mount.New(mountHelper(t))
	serverDir := mkSub(t, s, "g")
	shared := filepath.Join(serverDir, "shared")
	if err := os.Mkdir(shared, 0o770); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(shared, 0, 4242); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o770); err != nil {
		t.Fatal(err)
	}
	target := mountShare(t, m, s.Source("g"), s.MountOptions())
	// t.TempDir's parent is 0700: let uid 1000 reach the mount point.
	if err := os.Chmod(filepath.Dir(target), 0o755); err != nil {
		t.Fatal(err)
	}
	run := func(groups []uint32, script string) error {
		cmd := exec.Command("/bin/sh", "-c", script)
		cmd.Dir = "/"
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000, Groups: groups}}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	dir := filepath.Join(target, "shared")
	if err := run([]uint32{4242}, "test -w "+dir+" && echo hi > "+dir+"/by-group"); err != nil {
		t.Errorf("write via supplementary group: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(shared, "by-group")); err != nil || string(b) != "hi\n" {
		t.Errorf("server side: %q, %v", b, err)
	}
	if err := run(nil, "echo no > "+dir+"/no-group"); err == nil {
		t.Error("write without the group succeeded")
	}
	if err := run(nil, "test -w "+dir); err == nil {
		t.Error("access(W_OK) without the group succeeded")
	}
}

func TestParseHelpers(t *testing.T) {
	s := &Server{Addr: "127.0.0.1", Share: "/export", Port: 1, MountPort: 2}
	if got := s.Source("a/b"); got != "127.0.0.1:/export/a/b" {
		t.Errorf("Source = %q", got)
	}
	if got := s.Source(""); got != "127.0.0.1:/export" {
		t.Errorf("Source(\"\") = %q", got)
	}
	if got := s.MountOptions(); !slices.Equal(got, []string{"port=1", "mountport=2"}) {
		t.Errorf("MountOptions = %v", got)
	}
}
