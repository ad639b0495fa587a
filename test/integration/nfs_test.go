package integration

// NFS classes through the API: the export is a local directory (framework.Export) that the
// controller's mount of server:share bind-mounts, so these tests show what dirpv does with
// claims, PVs and the directories on the server, not what NFS does. NFS itself (the kernel's
// client and server, mount options in /proc/mounts, onDelete on the server, a dead server,
// root_squash, pods sharing a claim) is tested in test/vm.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// nfsClass creates an Immediate StorageClass for srv's export with mountOptions; tests pass
// distinct options so that their class gets its own controller mount.
func nfsClass(t *testing.T, srv *framework.Export, mountOptions []string, params map[string]string, opts ...framework.ClassOption) *storagev1.StorageClass {
	t.Helper()
	p := map[string]string{"backend": "nfs", "server": srv.Addr, "share": srv.Share}
	maps.Copy(p, params)
	opts = append([]framework.ClassOption{framework.Immediate, framework.MountOptions(mountOptions...)}, opts...)
	return suite.CreateClass(t, className(t), p, opts...)
}

// controllerMountsOf lists the live mounts of srv's export under the controller's --work-dir,
// where it mounts NFS exports, made with exactly the given options (the test and the
// controller share the mount namespace). Mounts stacked on one directory count once each.
func controllerMountsOf(t *testing.T, srv *framework.Export, options []string) []framework.ExportMount {
	t.Helper()
	mounts, err := srv.MountsUnder(flagOf(t, ctrlProc, "--work-dir"))
	must(t, err)
	return slices.DeleteFunc(mounts, func(m framework.ExportMount) bool {
		return m.Source != srv.Source("") || !slices.Equal(m.Options, options)
	})
}

// claimsOnServer lists the names in srv's export that belong to namespace ns: the default
// path pattern starts with the namespace and archived directories keep it after "archived-".
func claimsOnServer(t *testing.T, srv *framework.Export, ns string) []string {
	t.Helper()
	var out []string
	for _, n := range entries(t, srv.ExportDir) {
		if strings.HasPrefix(strings.TrimPrefix(n, "archived-"), ns+"-") {
			out = append(out, n)
		}
	}
	return out
}

// trashOnServer is where dirpv controller moves deleted NFS volumes until their trees are
// removed (volume/export/trash.go).
const trashOnServer = ".dirpv-trash"

// holdFile creates path and makes it impossible to unlink (the immutable attribute) until
// release is called: a removal that cannot finish, as one an NFS server is slow over would not,
// on an export that is a local directory and removes 100k files in about a second.
func holdFile(t *testing.T, path string) (release func()) {
	t.Helper()
	const fsImmutableFL = 0x10 // FS_IMMUTABLE_FL, linux/fs.h
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	must(t, err)
	flags, err := unix.IoctlGetUint32(fd, unix.FS_IOC_GETFLAGS)
	if err == nil {
		err = unix.IoctlSetPointerInt(fd, unix.FS_IOC_SETFLAGS, int(flags|fsImmutableFL))
	}
	if err != nil {
		unix.Close(fd)
		t.Fatalf("make %s immutable: %v", path, err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			// Through the descriptor: the file has moved to the trash since.
			if err := unix.IoctlSetPointerInt(fd, unix.FS_IOC_SETFLAGS, int(flags)); err != nil {
				t.Errorf("release %s: %v", path, err)
			}
			unix.Close(fd)
		})
	}
	t.Cleanup(release)
	return release
}

// Deleting a claim whose volume holds 100k files does not take the export down: the PV goes
// within the usual wait though the tree's removal cannot finish (a file in it is held), another
// claim on the same export binds meanwhile on the same mount, and once the file is released
// the retried removal takes the tree off the server.
func TestNFSLargeDeleteKeepsExportServing(t *testing.T) {
	const files = 100_000
	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, []string{"nolock", "actimeo=2"}, nil)
	suite.CreateClaim(t, ns, "big", class.Name, framework.AccessModes(v1.ReadWriteMany))
	_, pv := waitBound(t, ns, "big")
	rel := pv.Spec.CSI.VolumeAttributes["path"]
	must(t, framework.FillEmptyFiles(filepath.Join(suite.NFS.ExportDir, rel), files))
	release := holdFile(t, filepath.Join(suite.NFS.ExportDir, rel, "held"))

	start := time.Now()
	deleteClaim(t, ns, "big")
	waitPVGone(t, pv.Name)
	pvGone := time.Since(start)
	if _, err := os.Lstat(filepath.Join(suite.NFS.ExportDir, rel)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume directory on the server after its PV is gone: %v, want it gone from its name", err)
	}
	suite.CreateClaim(t, ns, "meanwhile", class.Name, framework.AccessModes(v1.ReadWriteMany))
	waitBound(t, ns, "meanwhile")
	bound := time.Since(start)
	trashed := filepath.Join(suite.NFS.ExportDir, trashOnServer, pv.Name)
	if _, err := os.Lstat(trashed); err != nil {
		t.Errorf("%s after the second claim bound: %v; want the tree still being removed", trashed, err)
	}
	if mounts := controllerMountsOf(t, suite.NFS, class.MountOptions); len(mounts) != 1 {
		t.Errorf("controller mounts of the export while the tree is removed: %d, want the one it had", len(mounts))
	}
	release()

	err := framework.Poll(context.Background(), 10*time.Minute, func(context.Context) (bool, error) {
		if _, err := os.Lstat(trashed); errors.Is(err, os.ErrNotExist) {
			return true, nil
		} else if err != nil {
			return false, err
		}
		return false, fmt.Errorf("%s is still on the server", trashed)
	})
	must(t, err, ctrlProc)
	t.Logf("%d files: PV gone after %v, second claim bound after %v, tree gone from the server after %v",
		files, pvGone.Round(time.Millisecond), bound.Round(time.Millisecond), time.Since(start).Round(time.Second))
}
