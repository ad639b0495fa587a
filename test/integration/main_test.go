// Package integration runs dirpv's controller and node processes, as built, against a real
// etcd, kube-apiserver, kube-controller-manager and kube-scheduler (test/cluster). Nodes are
// Node objects marked Ready without a kubelet: the scheduler places pods and claims on them,
// which is all provisioning needs.
package integration

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/nfs"
)

const (
	// nodeA runs a dirpv node instance; nodeC is a Ready node with none.
	nodeA = "node-a"
	nodeC = "node-c"
)

var (
	client      kubernetes.Interface
	testCluster *cluster.Cluster
	dirpvBin    string
	logDir      string
	// baseRoot holds one base directory per local class.
	baseRoot string
	nodeProc *framework.Process
	ctrlProc *framework.Process
	// nfsServer is a real NFS-Ganesha; the controller reaches it through the test-only FUSE
	// mount helper, since this kernel has no NFS client.
	nfsServer *nfs.Server
	// mountHelper is the test-only NFS client handed to dirpv with --nfs-mount-helper.
	mountHelper string
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
	work, err := framework.NewWorkspace("dirpv-it-", cleanups, *keepLogs)
	if err != nil {
		return fail("workspace", err)
	}
	logDir, baseRoot = work.LogDir, work.BaseRoot

	start := time.Now()
	// The binding ceiling: kube-controller-manager's own client limit (20 QPS) would otherwise
	// dominate the bulk tests (see shared notes on the binding ceiling).
	testCluster, err = cluster.Start(ctx, cluster.Options{
		ControllerManagerArgs: []string{"--kube-api-qps=200", "--kube-api-burst=400"},
		Logf:                  klog.Infof,
	})
	if err != nil {
		return fail("start cluster", err)
	}
	cleanups.Add(func() { testCluster.Stop() })
	if client, err = testCluster.Client(); err != nil {
		return fail("client", err)
	}
	for _, n := range []string{nodeA, nodeC} {
		if err := testCluster.CreateReadyNode(ctx, n, map[string]string{"kubernetes.io/hostname": "host-" + n}); err != nil {
			return fail("create node", err)
		}
	}
	if dirpvBin, err = framework.BuildDirpv(ctx, work.Dir); err != nil {
		return fail("build dirpv", err)
	}
	nfsServer, mountHelper, err = framework.StartNFS(ctx, work, cleanups)
	if err != nil {
		return fail("NFS", err)
	}

	common := []string{"--kubeconfig", testCluster.Kubeconfig, "--v=2", "--operation-timeout=10s"}
	ctrlProc, err = framework.StartDirpv(ctx, dirpvBin, "controller", logDir, "controller", append(common,
		"--work-dir", filepath.Join(work.Dir, "controller"),
		"--nfs-mount-helper", mountHelper,
		"--leader-election=true", "--leader-election-namespace=kube-system")...)
	if err != nil {
		return fail("start controller", err)
	}
	cleanups.Add(func() { ctrlProc.Stop(10 * time.Second) })
	nodeProc, err = framework.StartDirpv(ctx, dirpvBin, "node-a", logDir, "node", append(common,
		"--node-name", nodeA, "--allowed-base-paths", baseRoot,
		"--csi-endpoint", "unix://"+filepath.Join(work.Dir, "csi-a.sock"),
		"--plugin-registration-dir", "-")...)
	if err != nil {
		return fail("start node-a", err)
	}
	cleanups.Add(func() { nodeProc.Stop(10 * time.Second) })
	// node-a's plugin does not register with a kubelet (there is none): list it in node-a's
	// CSINode as kubelet would, so the controller sees a node plugin there and not on node-c.
	if err := testCluster.RegisterCSIDriver(ctx, nodeA, "dirpv.io"); err != nil {
		return fail("register node-a's plugin", err)
	}
	fmt.Fprintf(os.Stderr, "integration setup took %s\n", time.Since(start).Round(time.Millisecond))

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
