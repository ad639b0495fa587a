// Package e2e runs dirpv on a real single-node cluster: kubelet with containerd and runc from
// test/cluster, dirpv controller and node as built processes on the host, the node plugin
// registering itself with kubelet, and pods writing real files.
package e2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/nfs"
)

var (
	client      kubernetes.Interface
	testCluster *cluster.Cluster
	logDir      string
	baseRoot    string
	nodeProc    *framework.Process
	ctrlProc    *framework.Process
	nfsServer   *nfs.Server
	keepLogs    = flag.Bool("keep-logs", false, "keep the processes' logs after the run")
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	cleanups := framework.NewCleanups()
	defer cleanups.Run()
	fail := func(what string, err error) int {
		fmt.Fprintf(os.Stderr, "%s: %v\n", what, err)
		return 1
	}
	work, err := framework.NewWorkspace("dirpv-e2e-", cleanups, *keepLogs)
	if err != nil {
		return fail("workspace", err)
	}
	logDir, baseRoot = work.LogDir, work.BaseRoot

	start := time.Now()
	testCluster, err = cluster.Start(ctx, cluster.Options{WithNode: true, Logf: klog.Infof})
	if err != nil {
		return fail("start cluster", err)
	}
	cleanups.Add(func() { testCluster.Stop() })
	if client, err = testCluster.Client(); err != nil {
		return fail("client", err)
	}
	dirpvBin, err := framework.BuildDirpv(ctx, work.Dir)
	if err != nil {
		return fail("build dirpv", err)
	}
	var mountHelper string
	nfsServer, mountHelper, err = framework.StartNFS(ctx, work, cleanups)
	if err != nil {
		return fail("NFS", err)
	}

	if err := createCSIDriver(ctx); err != nil {
		return fail("CSIDriver", err)
	}
	common := []string{"--kubeconfig", testCluster.Kubeconfig, "--v=2", "--operation-timeout=10s", "--nfs-mount-helper", mountHelper}
	ctrlProc, err = framework.StartDirpv(ctx, dirpvBin, "controller", logDir, "controller", append(common,
		"--work-dir", filepath.Join(work.Dir, "controller"), "--leader-election=false")...)
	if err != nil {
		return fail("start controller", err)
	}
	cleanups.Add(func() { ctrlProc.Stop(10 * time.Second) })
	nodeProc, err = framework.StartDirpv(ctx, dirpvBin, "node", logDir, "node", append(common,
		"--node-name", testCluster.NodeName, "--kubelet-root-dir", testCluster.KubeletRootDir,
		"--allowed-base-paths", baseRoot)...)
	if err != nil {
		return fail("start node plugin", err)
	}
	// Before the cluster stops: kubelet must still be there to unpublish what pods used.
	cleanups.Add(func() { nodeProc.Stop(10 * time.Second) })
	if err := waitRegistered(ctx); err != nil {
		return fail("node plugin registration", fmt.Errorf("%w\n%s", err, nodeProc.Tail(3000)))
	}
	fmt.Fprintf(os.Stderr, "e2e setup took %s\n", time.Since(start).Round(time.Millisecond))

	code := m.Run()
	for _, p := range []*framework.Process{ctrlProc, nodeProc} {
		if exited, err := p.Exited(); exited {
			fmt.Fprintf(os.Stderr, "%s exited during the tests: %v\n%s\n", p.Name, err, p.Tail(4000))
			code = 1
		}
	}
	if code == 0 {
		work.Succeeded()
	}
	return code
}

// createCSIDriver creates the CSIDriver object as deploy/ does: no attach, so kubelet calls
// NodePublishVolume directly.
func createCSIDriver(ctx context.Context) error {
	fsGroup := storagev1.FileFSGroupPolicy
	d := &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: "dirpv.io"},
		Spec: storagev1.CSIDriverSpec{
			AttachRequired:       ptr.To(false),
			PodInfoOnMount:       ptr.To(true),
			FSGroupPolicy:        &fsGroup,
			VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
		},
	}
	_, err := client.StorageV1().CSIDrivers().Create(ctx, d, metav1.CreateOptions{})
	return err
}

// waitRegistered waits until kubelet lists dirpv.io in the node's CSINode object.
func waitRegistered(ctx context.Context) error {
	return framework.WaitForDriverRegistered(ctx, client, testCluster.NodeName, 60*time.Second)
}
