// Package integration runs dirpv's controller and node processes, as built, against a real
// etcd, kube-apiserver, kube-controller-manager and kube-scheduler (test/cluster). Nodes are
// Node objects marked Ready without a kubelet: the scheduler places pods and claims on them,
// which is all provisioning needs.
package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
)

const (
	// nodeA runs a dirpv node instance; nodeC is a Ready node with none.
	nodeA = "node-a"
	nodeC = "node-c"
)

var (
	suite    *framework.Suite
	nodeProc *framework.Process
	ctrlProc *framework.Process
	// snaps is a client of the snapshot API, whose CRDs setup installs.
	snaps snapclientset.Interface
)

func TestMain(m *testing.M) {
	os.Exit(framework.RunSuite(m, framework.SuiteOptions{
		Name: "it",
		// The binding ceiling: kube-controller-manager's own client limit (20 QPS) would
		// otherwise dominate the bulk tests (see shared notes on the binding ceiling).
		Cluster: cluster.Options{ControllerManagerArgs: []string{"--kube-api-qps=200", "--kube-api-burst=400"}, Logf: klog.Infof},
		Dirpv:   true,
		// An export that is a local directory, bind-mounted where the controller mounts it
		// (framework.Export): the NFS classes' tests are of dirpv's API side.
		NFS: true,
	}, setup))
}

// setup starts a controller under leader election and node-a's node instance; local classes
// get their base directories under suite.Work.BaseRoot.
func setup(ctx context.Context, s *framework.Suite) error {
	suite = s
	for _, n := range []string{nodeA, nodeC} {
		if err := suite.Cluster.CreateReadyNode(ctx, n, map[string]string{"kubernetes.io/hostname": "host-" + n}); err != nil {
			return fmt.Errorf("create node: %w", err)
		}
	}
	// Where the processes, which run in no pod, publish CSIStorageCapacity by default.
	if _, err := suite.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "dirpv"}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create namespace dirpv: %w", err)
	}
	// VolumeSnapshots as deploy/components/snapshots installs them: the CRDs, then the common
	// snapshot controller from dirpv's binary. Before dirpv starts, so that its snapshot
	// controllers start at once.
	var err error
	if snaps, err = framework.InstallSnapshotCRDs(ctx, s.Cluster.Kubeconfig); err != nil {
		return err
	}
	snapCtrl, err := s.StartDirpv(ctx, "snapshot-controller", "snapshot-controller", "--v=4", "--leader-election=false")
	if err != nil {
		return fmt.Errorf("start snapshot-controller: %w", err)
	}
	s.Daemons = append(s.Daemons, snapCtrl)
	// TestTakeOverFrom* make PVs as these provisioners do.
	common := []string{"--v=2", "--operation-timeout=10s", "--adopt-provisioners=" + nfsSubdir + "," + localPath}
	ctrlProc, err = s.StartDirpv(ctx, "controller", "controller", append(common,
		"--work-dir", filepath.Join(s.Work.Dir, "controller"),
		"--leader-election=true", "--leader-election-namespace=kube-system")...)
	if err != nil {
		return fmt.Errorf("start controller: %w", err)
	}
	nodeProc, err = s.StartDirpv(ctx, "node-a", "node", append(common,
		"--node-name", nodeA, "--allowed-base-paths", s.Work.BaseRoot,
		"--csi-endpoint", "unix://"+filepath.Join(s.Work.Dir, "csi-a.sock"),
		"--plugin-registration-dir", "-",
		// TestNestedSubvolumeIsReported waits for a few of them.
		"--quota-check-period", quotaCheckPeriod.String())...)
	if err != nil {
		return fmt.Errorf("start node-a: %w", err)
	}
	s.Daemons = append(s.Daemons, ctrlProc, nodeProc)
	// node-a's plugin does not register with a kubelet (there is none): list it in node-a's
	// CSINode as kubelet would, so the controller sees a node plugin there and not on node-c.
	if err := suite.Cluster.RegisterCSIDriver(ctx, nodeA, "dirpv.io"); err != nil {
		return fmt.Errorf("register node-a's plugin: %w", err)
	}
	return nil
}
