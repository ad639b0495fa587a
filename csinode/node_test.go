package csinode

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for real mounts")
	}
}

// newTestDriver returns a driver that allows local volumes anywhere under the temp dir, where
// localVolume makes them; trust_test.go checks the allow-list itself.
func newTestDriver(t *testing.T, m mount.Interface, timeout time.Duration) (*Driver, *nodeServer) {
	return driverAllowing(t, m, timeout, filepath.Join(t.TempDir(), "kubelet"), os.TempDir())
}

// driverAllowing returns a driver that allows local volumes under the allowed base paths, with
// kubelet's root dir at kubelet.
func driverAllowing(t *testing.T, m mount.Interface, timeout time.Duration, kubelet string, allowed ...string) (*Driver, *nodeServer) {
	t.Helper()
	bases, err := volume.NewAllowedBases(allowed, kubelet)
	must(t, err)
	d, err := NewDriver(Options{
		DriverName: "dirpv.io", Version: "test", NodeID: "node-1",
		Endpoint: "unix://" + filepath.Join(t.TempDir(), "csi.sock"),
		Mounter:  m, OperationTimeout: timeout, LocalBases: bases,
	})
	must(t, err)
	return d, &nodeServer{d: d}
}

// localVolume creates base/rel and returns its attributes.
func localVolume(t *testing.T, rel string) (base string, attrs volume.Attributes) {
	t.Helper()
	base = t.TempDir()
	root, err := volume.OpenRoot(base)
	must(t, err)
	defer root.Close()
	_, err = root.MkdirAll(rel, volume.Owner{Mode: 0o777, UID: -1, GID: -1}, volume.Claim{UID: "uid-test", PVName: "pv-test"})
	must(t, err)
	return base, volume.Attributes{Backend: volume.BackendLocal, BasePath: base, Path: rel}
}

// newTarget returns a target path whose parent exists (as kubelet leaves it) and makes sure
// nothing stays mounted there after the test, before the temp dir is removed.
func newTarget(t *testing.T) string {
	t.Helper()
	target := filepath.Join(t.TempDir(), "target")
	t.Cleanup(func() {
		for range maxStackedMounts {
			if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
				return
			}
		}
	})
	return target
}

// isMounted reads the kernel's mount table for the calling process.
func isMounted(t *testing.T, target string) bool {
	t.Helper()
	infos, err := mount.ParseMountInfo("/proc/self/mountinfo")
	must(t, err)
	return slices.ContainsFunc(infos, func(mi mount.MountInfo) bool { return mi.MountPoint == target })
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func publishReq(id, target string, attrs volume.Attributes, c *csi.VolumeCapability, ro bool) *csi.NodePublishVolumeRequest {
	return &csi.NodePublishVolumeRequest{
		VolumeId: id, TargetPath: target, VolumeCapability: c, Readonly: ro,
		VolumeContext: attrs.Map(),
	}
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantCode(t *testing.T, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v (code %s), want code %s", err, status.Code(err), code)
	}
}

// publish publishes req, failing the test on an error.
func publish(t *testing.T, ns *nodeServer, req *csi.NodePublishVolumeRequest) {
	t.Helper()
	if _, err := ns.NodePublishVolume(context.Background(), req); err != nil {
		t.Fatalf("publish %s at %s: %v", req.VolumeId, req.TargetPath, err)
	}
}

// unpublish unpublishes the volume id at target, failing the test on an error.
func unpublish(t *testing.T, ns *nodeServer, id, target string) {
	t.Helper()
	if _, err := ns.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}); err != nil {
		t.Fatalf("unpublish %s at %s: %v", id, target, err)
	}
}

// What test/sanity's csi-sanity run does not check of a local publish: a read-only publish at the
// target of a read-write one is refused, a multi-writer publish of a single-writer volume at a
// second target is fine (a second single-writer one is csi-sanity's "should fail when volume with
// single node single writer access mode is already mounted at a different target path"), and
// health answers for the volume, and stats no longer once it is unpublished (stats at the
// target, and not for another volume's ID: test/e2e/install's TestSymlinksToHostSurviveDeleteArchiveAndStats).
// That publish is idempotent and unpublish removes the target, csi-sanity checks ("should be
// idempotent", "should remove target path"); that a pod's data lands in the volume's directory,
// test/vm/node's TestLocalClaimOnGuestDisk.
func TestPublishLocalBindMount(t *testing.T) {
	requireRoot(t)
	ctx := context.Background()
	_, ns := newTestDriver(t, mount.New(""), 10*time.Second)
	_, attrs := localVolume(t, "ns/vol-1")
	target, second := newTarget(t), newTarget(t)
	rw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
	publish(t, ns, publishReq("vol-1", target, attrs, rw, false))
	_, err := ns.NodePublishVolume(ctx, publishReq("vol-1", target, attrs, rw, true))
	wantCode(t, err, codes.AlreadyExists)
	publish(t, ns, publishReq("vol-1", second, attrs, mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER), false))
	unpublish(t, ns, "vol-1", second)

	h, err := ns.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "vol-1"})
	if err != nil || len(h.GetVolumeHealth().GetHealthStatuses()) != 0 {
		t.Errorf("health of a good volume: %v, %v", h, err)
	}
	unpublish(t, ns, "vol-1", target)
	unpublish(t, ns, "vol-1", target) // OK again: csi-sanity lets a repeat answer NotFound
	_, err = ns.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "vol-1", VolumePath: target})
	wantCode(t, err, codes.NotFound)
}

func TestPublishLocalReadOnly(t *testing.T) {
	requireRoot(t)
	_, ns := newTestDriver(t, mount.New(""), 10*time.Second)
	for _, tc := range []struct {
		name string
		mode csi.VolumeCapability_AccessMode_Mode
		ro   bool
	}{
		{"readonly flag", csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, true},
		{"reader-only mode", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, attrs := localVolume(t, "vol")
			target := newTarget(t)
			// "rw" among the PV's mount options must not undo a read-only publish.
			req := publishReq("vol", target, attrs, mountCap(tc.mode, "nosuid", "rw", "nodev"), tc.ro)
			publish(t, ns, req)
			err := os.WriteFile(filepath.Join(target, "x"), nil, 0o644)
			if !errors.Is(err, unix.EROFS) {
				t.Fatalf("write to read-only volume: got %v, want EROFS", err)
			}
			publish(t, ns, req)
			unpublish(t, ns, "vol", target)
			if isMounted(t, target) {
				t.Error("still mounted")
			}
		})
	}
}

// Requests refused before anything is made. A missing volume ID, target path or capability,
// to publish or unpublish, is csi-sanity's (test/sanity: "should fail when no ... is provided").
func TestPublishValidation(t *testing.T) {
	_, ns := newTestDriver(t, mount.NewFakeMounter(nil), time.Second)
	local := volume.Attributes{Backend: volume.BackendLocal, BasePath: "/var/lib/dirpv", Path: "v"}
	rw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	target := filepath.Join(t.TempDir(), "target")
	block := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	for name, req := range map[string]*csi.NodePublishVolumeRequest{
		"relative target": publishReq("v", "rel/target", local, rw, false),
		"block":           publishReq("v", target, local, block, false),
		"RWX on local":    publishReq("v", target, local, mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), false),
		"unknown mode":    publishReq("v", target, local, mountCap(csi.VolumeCapability_AccessMode_UNKNOWN), false),
		"NFS option on local": publishReq("v", target, local,
			mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "nfsvers=4.1"), false),
		"escaping path": {VolumeId: "v", TargetPath: target, VolumeCapability: rw,
			VolumeContext: map[string]string{"backend": "local", "basePath": "/b", "path": "../etc"}},
		"unknown attribute": {VolumeId: "v", TargetPath: target, VolumeCapability: rw,
			VolumeContext: map[string]string{"backend": "local", "basePath": "/b", "path": "v", "pth": "x"}},
		"no attributes": {VolumeId: "v", TargetPath: target, VolumeCapability: rw},
		"nfs without server": {VolumeId: "v", TargetPath: target, VolumeCapability: rw,
			VolumeContext: map[string]string{"backend": "nfs", "share": "/export", "path": "v"}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ns.NodePublishVolume(context.Background(), req)
			wantCode(t, err, codes.InvalidArgument)
			if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("target created for a refused request: %v", err)
			}
		})
	}
	_, err := ns.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{})
	wantCode(t, err, codes.Unimplemented)
}

// A repeated NFS publish mounts once, and a publish of another source at a target is refused.
// What reaches mount(8) (server:share/path, type nfs, the PV's options and ro for a read-only
// publish), test/vm/node's TestNFSv3NolockReadOnlyOnGuestNode shows in its pods' mounts; the
// kernel client mounting it, and unpublish with it, csi-sanity there (test/vm/kernel
// TestSanityNFS).
func TestPublishNFSOnce(t *testing.T) {
	fake := mount.NewFakeMounter(nil)
	_, ns := newTestDriver(t, fake, time.Second)
	attrs := volume.Attributes{Backend: volume.BackendNFS, Server: "nfs.example", Share: "/export", Path: "ns/pvc-1"}
	target := filepath.Join(t.TempDir(), "target")
	c := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "nfsvers=4.1", "hard")
	for range 2 {
		publish(t, ns, publishReq("pvc-1", target, attrs, c, true))
	}
	if log := fake.GetLog(); len(log) != 1 {
		t.Fatalf("want exactly one mount (second publish idempotent), got %+v", log)
	}
	other := attrs
	other.Path = "ns/pvc-2"
	_, err := ns.NodePublishVolume(context.Background(), publishReq("pvc-2", target, other, c, true))
	wantCode(t, err, codes.AlreadyExists)
}

// blockingMounter wraps a mounter whose Mount, while blockMount is set, hangs until release,
// like mount(8) against a dead NFS server. (An unmount that hangs, test/vm/kernel's
// TestDeadServerHardMount meets on a dead hard mount of the kernel's NFS client.)
type blockingMounter struct {
	mount.Interface
	blockMount atomic.Bool
	release    chan struct{}
}

func (m *blockingMounter) Mount(source, target, fstype string, options []string) error {
	if m.blockMount.Load() {
		<-m.release
		return errors.New("server unreachable")
	}
	return m.Interface.Mount(source, target, fstype, options)
}

func TestPublishHungMountTimesOut(t *testing.T) {
	ctx := context.Background()
	bm := &blockingMounter{Interface: mount.NewFakeMounter(nil), release: make(chan struct{})}
	bm.blockMount.Store(true)
	release := sync.OnceFunc(func() { close(bm.release) })
	t.Cleanup(release)
	const opTimeout = 500 * time.Millisecond
	_, ns := newTestDriver(t, bm, opTimeout)
	attrs := volume.Attributes{Backend: volume.BackendNFS, Server: "dead.example", Share: "/export", Path: "v"}
	target := filepath.Join(t.TempDir(), "target")
	req := publishReq("v", target, attrs, mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), false)
	_, err := ns.NodePublishVolume(ctx, req)
	wantCode(t, err, codes.DeadlineExceeded)
	// The hung mount still owns the target: a retry is told so at once.
	start := time.Now()
	_, err = ns.NodePublishVolume(ctx, req)
	wantCode(t, err, codes.Aborted)
	// Waiting for the hung call would take the whole operation timeout; a fixed bound below
	// that would only measure how loaded the machine is.
	if d := time.Since(start); d >= opTimeout {
		t.Errorf("retry waited %v (the operation timeout is %v) instead of failing fast", d, opTimeout)
	}
	// Once mount(8) gives up, the key is free again.
	release()
	bm.blockMount.Store(false)
	err = wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 5*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := ns.NodePublishVolume(ctx, req)
		if status.Code(err) == codes.Aborted {
			return false, nil // the background mount still holds the key
		}
		return true, err
	})
	if err != nil {
		t.Fatalf("publish after the hung mount returned: %v", err)
	}
}

// swappingMounter replaces the volume directory with a symlink to another directory just
// before the bind mount runs: the race that a path-based bind mount would lose.
type swappingMounter struct {
	mount.Interface
	dir, outside string
}

func (m *swappingMounter) MountSensitiveWithoutSystemdWithMountFlags(source, target, fstype string, options, sensitive, flags []string) error {
	if err := os.Rename(m.dir, m.dir+".moved"); err != nil {
		return err
	}
	if err := os.Symlink(m.outside, m.dir); err != nil {
		return err
	}
	return m.Interface.MountSensitiveWithoutSystemdWithMountFlags(source, target, fstype, options, sensitive, flags)
}

func TestPublishLocalBindsTheCheckedDirectory(t *testing.T) {
	requireRoot(t)
	base, attrs := localVolume(t, "vol")
	outside := t.TempDir()
	must(t, os.WriteFile(filepath.Join(outside, "secret"), nil, 0o600))
	must(t, os.WriteFile(filepath.Join(base, "vol", "mine"), nil, 0o600))
	sm := &swappingMounter{Interface: mount.New(""), dir: filepath.Join(base, "vol"), outside: outside}
	_, ns := newTestDriver(t, sm, 10*time.Second)
	target := newTarget(t)
	publish(t, ns, publishReq("vol", target, attrs, mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), false))
	if _, err := os.Stat(filepath.Join(target, "mine")); err != nil {
		t.Errorf("target does not show the volume directory that was checked: %v", err)
	}
	if _, err := os.Stat(filepath.Join(target, "secret")); err == nil {
		t.Error("bind mount followed the symlink swapped in after the check")
	}
	unpublish(t, ns, "vol", target)
}
