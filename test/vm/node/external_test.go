package node_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/cluster"
	externale2e "github.com/dirpv/dirpv/test/external-e2e"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/node"
)

// nfsE2EClass is the class external-nfs.yaml names.
const nfsE2EClass = "dirpv-nfs-e2e"

// nfsE2EFocus is the part of the External Storage suite run against the NFS class: what RWX
// volumes on an export are for (several pods at once on one volume, read-only too), subPath
// mounts into an NFS volume, data and exec, and the class's mount options reaching the mount.
// The whole suite would take about an hour under the guest's emulation.
const nfsE2EFocus = `External.Storage.*(` +
	`multiVolume should concurrently access the single (read-only )?volume from pods on the same node|` +
	`subPath should support (existing directory|existing single file|readOnly directory specified in the volumeMount)|` +
	`subPath should be able to unmount after the subpath directory is deleted|` +
	`volumes should (store data|allow exec of files on the volume)|` +
	`provisioning should provision storage with mount options)`

// TestExternalStorageNFSOnGuestNode runs a part of Kubernetes' External Storage suite
// (nfsE2EFocus) with an NFS class of dirpv on the guest's kernel NFS server: its pods mount
// through the guest kernel's NFS client. Every volume the suite made is gone from the export
// afterwards.
func TestExternalStorageNFSOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	run := e2eRun(ctx, t, "external-nfs.yaml", nfsE2EFocus)
	suite.CreateClass(t, nfsE2EClass, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": "/"},
		framework.Immediate, framework.MountOptions("nfsvers=4.2", "hard"))
	before := exportEntries(ctx, t)
	run.Do(t)

	// The suite's namespaces are gone when it ends; its PVs and their directories follow.
	err := framework.Poll(ctx, 3*time.Minute, func(ctx context.Context) (bool, error) {
		pvs, err := suite.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		var left []string
		for _, pv := range pvs.Items {
			if strings.HasPrefix(pv.Spec.StorageClassName, nfsE2EClass) {
				left = append(left, pv.Name)
			}
		}
		return len(left) == 0, fmt.Errorf("PVs of the suite's classes left: %v", left)
	})
	if err != nil {
		t.Fatal(err)
	}
	after := exportEntries(ctx, t)
	if left := slices.DeleteFunc(after, func(n string) bool { return slices.Contains(before, n) }); len(left) > 0 {
		t.Errorf("volume directories the suite left on the export: %v", left)
	}
}

// exportEntries lists the export's volume directories on the server, without dirpv's own
// entries (.dirpv-*: records, trash).
func exportEntries(ctx context.Context, t *testing.T) []string {
	t.Helper()
	out, err := guestNode.Exec(ctx, time.Minute, "ls", "-A", node.NFSExportDir)
	if err != nil {
		t.Fatal(err)
	}
	return slices.DeleteFunc(strings.Fields(out), func(n string) bool { return strings.HasPrefix(n, ".dirpv-") })
}

// TestExternalStorageLocalXFSOnGuestNode runs the External Storage suite's one check that
// needs a base with project quota, which the host tier's base lacks (test/external-e2e skips
// it there): a claim restored from a snapshot into a larger size than its source's shows its
// own size in the pod's df, on the guest's XFS disk.
func TestExternalStorageLocalXFSOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	run := e2eRun(ctx, t, "external-local-xfs.yaml",
		`External.Storage.*should provision correct filesystem size when restoring snapshot to larger size pvc`)
	suite.CreateClass(t, "dirpv-local-xfs-e2e", map[string]string{"backend": "local", "basePath": node.XFSBase,
		"capacityEnforcement": "required"}, framework.AllowVolumeExpansion)
	run.Do(t)
}

// e2eRun readies a run of the External Storage suite against the guest node: e2e.test built
// (cached), and the images its focused tests run imported into the guest, once per package.
func e2eRun(ctx context.Context, t *testing.T, driver, focus string) externale2e.Run {
	t.Helper()
	e2eImages.once.Do(func() {
		binDir, err := cluster.BuildE2E(ctx)
		if err != nil {
			e2eImages.err = fmt.Errorf("build e2e.test: %w", err)
			return
		}
		repoList := filepath.Join(suite.Work.Dir, "repo-list.yaml")
		if err := os.WriteFile(repoList, []byte(externale2e.RepoListYAML), 0o644); err != nil {
			e2eImages.err = err
			return
		}
		start := time.Now()
		e2eImages.err = externale2e.ProvideImages(ctx, guestNode, cluster.BusyboxImage, cluster.PauseImage, suite.Work.Dir,
			filepath.Join(binDir, "e2e.test"), filepath.Join(binDir, "agnhost"), repoList)
		t.Logf("the suite's images are in the guest after %s", time.Since(start).Round(time.Second))
		e2eImages.binDir, e2eImages.repoList = binDir, repoList
	})
	if e2eImages.err != nil {
		t.Fatal(e2eImages.err)
	}
	return externale2e.Run{
		Driver: driver, BinDir: e2eImages.binDir, RepoList: e2eImages.repoList,
		Kubeconfig: suite.Cluster.Kubeconfig, KubeletRootDir: cluster.KubeletRootDir,
		WorkDir: suite.Work.Dir, LogDir: suite.Work.LogDir,
		Focus: focus, Skips: []externale2e.Skip{externale2e.SkipDisruptive, externale2e.SkipVolumeDataSource},
		Procs: 3, Timeout: 15 * time.Minute,
	}
}

// e2eImages is e2eRun's one-time preparation.
var e2eImages struct {
	once             sync.Once
	binDir, repoList string
	err              error
}
