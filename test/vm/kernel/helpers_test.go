package kernel

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/mount-utils"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/csinode"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
)

const driverName = "dirpv.io"

func TestMain(m *testing.M) { guest.Main(m) }

var (
	nfsOnce sync.Once
	nfsSrv  *guest.NFSServer
	nfsErr  error
)

// nfsServer is the guest's kernel NFS server, started by the first test that needs it. The
// guest has one nfsd, so tests share it and each exports its own directory.
func nfsServer(t *testing.T) *guest.NFSServer {
	t.Helper()
	nfsOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		nfsSrv, nfsErr = guest.StartNFS(ctx)
	})
	if nfsErr != nil {
		t.Fatalf("starting the kernel NFS server: %v", nfsErr)
	}
	return nfsSrv
}

// exportFor exports a fresh directory for clients mounting with mountOptions and returns it
// and the share a class names: its path for NFSv3, "/" for NFSv4, which mounts it as the root
// of the pseudo file system (see guest.V4Root).
func exportFor(t *testing.T, mountOptions []string, options ...string) (dir, share string) {
	t.Helper()
	return exportDirFor(t, t.TempDir(), mountOptions, options...)
}

// exportDirFor is exportFor of an existing directory (made writable by everyone), exported
// with options until the test ends.
func exportDirFor(t *testing.T, dir string, mountOptions []string, options ...string) (string, string) {
	t.Helper()
	share := dir
	if !slices.Contains(mountOptions, "nfsvers=3") && !slices.Contains(mountOptions, "vers=3") {
		share, options = "/", append(options, guest.V4Root)
	}
	must(t, os.Chmod(dir, 0o777))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	unexport, err := nfsServer(t).Export(ctx, dir, options...)
	must(t, err)
	t.Cleanup(func() {
		if err := unexport(); err != nil {
			t.Errorf("unexport %s: %v", dir, err)
		}
	})
	return dir, share
}

// openExport mounts the guest's export share with the kernel client and options, as the
// controller does, and returns it as a Root; the test's cleanups close and unmount it.
func openExport(t *testing.T, share string, options []string) *volume.Root {
	t.Helper()
	mnt := t.TempDir()
	m := mount.New("")
	if err := m.Mount(guest.NFSAddr+":"+share, mnt, "nfs", options); err != nil {
		t.Fatalf("mount the export %s: %v", share, err)
	}
	t.Cleanup(func() {
		if err := mount.CleanupMountPoint(mnt, m, false); err != nil {
			t.Errorf("unmount the export at %s: %v", mnt, err)
		}
	})
	root, err := volume.OpenRoot(mnt)
	must(t, err)
	t.Cleanup(func() { root.Close() })
	return root
}

// controllerFixture is `dirpv controller` below the API: the real Provisioner with the system
// mount(8) (so the real mount.nfs), a fake clientset for the API side.
type controllerFixture struct {
	p       *provisioner.Provisioner
	classes cache.Indexer
	work    string
}

func newController(t *testing.T, timeout time.Duration) *controllerFixture {
	t.Helper()
	f := &controllerFixture{work: t.TempDir(), classes: cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})}
	var err error
	f.p, err = provisioner.New(provisioner.Config{
		DriverName: driverName, Role: provisioner.RoleController,
		Client: fake.NewClientset(), Classes: storagelisters.NewStorageClassLister(f.classes),
		Mounter: mount.New(""), WorkDir: f.work, OperationTimeout: timeout,
	})
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { f.p.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			t.Error("provisioner did not release its NFS mounts within 2m")
		}
		// What a user would check after dirpv controller stops: nothing stays mounted.
		if left, _ := framework.MountsUnder(f.work); len(left) > 0 {
			t.Errorf("mounts left under the controller's work dir after it stopped: %v", left)
			framework.DetachMountsUnder(f.work)
		}
	})
	return f
}

// nfsClass adds an NFS StorageClass of 127.0.0.1:share to the fixture's lister.
func (f *controllerFixture) nfsClass(name, share string, mountOptions []string, params map[string]string) *storagev1.StorageClass {
	p := map[string]string{"backend": "nfs", "server": guest.NFSAddr, "share": share}
	for k, v := range params {
		p[k] = v
	}
	c := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: driverName,
		Parameters: p, MountOptions: mountOptions}
	if err := f.classes.Add(c); err != nil {
		panic(err)
	}
	return c
}

// provision runs Provision for a new RWX claim of class in namespace ns, as the lib's
// controller would.
func (f *controllerFixture) provision(ctx context.Context, class *storagev1.StorageClass, name string) (*v1.PersistentVolume, error) {
	return f.provisionIn(ctx, class, "ns", name, types.UID("uid-"+name))
}

// provisionIn is provision for the claim namespace/name with uid.
func (f *controllerFixture) provisionIn(ctx context.Context, class *storagev1.StorageClass, namespace, name string, uid types.UID) (*v1.PersistentVolume, error) {
	pvc := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, UID: uid},
		Spec: v1.PersistentVolumeClaimSpec{
			StorageClassName: &class.Name,
			AccessModes:      []v1.PersistentVolumeAccessMode{v1.ReadWriteMany},
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	pv, state, err := f.p.Provision(ctx, controller.ProvisionOptions{StorageClass: class, PVName: "pvc-" + string(pvc.UID), PVC: pvc})
	if err == nil && state != controller.ProvisioningFinished {
		err = fmt.Errorf("provisioning state %s", state)
	}
	return pv, err
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// nodeFixture is `dirpv node`'s CSI node service on a socket, called as kubelet calls it.
type nodeFixture struct {
	csi.NodeClient
	// localBase is the one base path local volumes may be published from.
	localBase string
}

// nodePlugin starts the node plugin with the given --operation-timeout.
func nodePlugin(t *testing.T, timeout time.Duration) *nodeFixture {
	t.Helper()
	tmp := t.TempDir()
	sock := filepath.Join(tmp, "csi.sock")
	n := &nodeFixture{localBase: filepath.Join(tmp, "local")}
	must(t, os.Mkdir(n.localBase, 0o755))
	bases, err := volume.NewAllowedBases([]string{n.localBase}, filepath.Join(tmp, "kubelet"))
	must(t, err)
	d, err := csinode.NewDriver(csinode.Options{DriverName: driverName, Version: "vm-test", NodeID: "dirpv-vm",
		Endpoint: "unix://" + sock, Mounter: mount.New(""), OperationTimeout: timeout, LocalBases: bases})
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("node plugin Run: %v", err)
		}
	})
	if err := framework.Poll(context.Background(), 30*time.Second, func(context.Context) (bool, error) {
		return d.Ready() == nil, d.Ready()
	}); err != nil {
		t.Fatalf("node plugin not serving: %v", err)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	n.NodeClient = csi.NewNodeClient(conn)
	return n
}

// localPV is a local volume in the node's base path, as the node instance provisions it.
func (n *nodeFixture) localPV(t *testing.T, name string) *v1.PersistentVolume {
	t.Helper()
	root, err := volume.OpenRoot(n.localBase)
	must(t, err)
	defer root.Close()
	if _, err := root.MkdirAll(name, volume.Owner{Mode: 0o777, UID: -1, GID: -1}, volume.Claim{UID: name, PVName: name}); err != nil {
		t.Fatal(err)
	}
	attrs := volume.Attributes{Backend: volume.BackendLocal, BasePath: n.localBase, Path: name}
	return &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: v1.PersistentVolumeSpec{
		PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
			Driver: driverName, VolumeHandle: name, VolumeAttributes: attrs.Map(),
		}},
	}}
}

// publishRequest is the NodePublishVolume call kubelet makes for pv at target.
func publishRequest(pv *v1.PersistentVolume, target string, readonly bool) *csi.NodePublishVolumeRequest {
	return &csi.NodePublishVolumeRequest{
		VolumeId: pv.Spec.CSI.VolumeHandle, TargetPath: target, Readonly: readonly,
		VolumeContext: pv.Spec.CSI.VolumeAttributes,
		VolumeCapability: &csi.VolumeCapability{
			// kubelet passes the PV's spec.mountOptions as the mount flags.
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: pv.Spec.MountOptions}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		},
	}
}
