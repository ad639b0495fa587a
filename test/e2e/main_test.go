// Package e2e runs dirpv on a real single-node cluster: kubelet with containerd and runc from
// test/cluster, dirpv controller and node as built processes on the host, the node plugin
// registering itself with kubelet, and pods writing real files.
package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
)

var (
	suite    *framework.Suite
	nodeProc *framework.Process
	ctrlProc *framework.Process
)

func TestMain(m *testing.M) {
	os.Exit(framework.RunSuite(m, framework.SuiteOptions{
		Name:    "e2e",
		Cluster: cluster.Options{WithNode: true, Logf: klog.Infof},
		Dirpv:   true,
	}, setup))
}

// setup runs the controller and the node plugin on the host, the node plugin registering
// itself with the suite's kubelet; local classes get their base directories under
// suite.Work.BaseRoot.
func setup(ctx context.Context, s *framework.Suite) error {
	suite = s
	if err := createCSIDriver(ctx); err != nil {
		return fmt.Errorf("CSIDriver: %w", err)
	}
	var err error
	common := []string{"--v=2", "--operation-timeout=10s", "--capacity-namespace", capacityNamespace}
	ctrlProc, err = s.StartDirpv(ctx, "controller", "controller", append(common,
		"--work-dir", filepath.Join(s.Work.Dir, "controller"), "--leader-election=false")...)
	if err != nil {
		return fmt.Errorf("start controller: %w", err)
	}
	// Started after the cluster, so stopped before it: kubelet must still be there to
	// unpublish what pods used.
	nodeProc, err = s.StartDirpv(ctx, "node", "node", append(common,
		"--node-name", suite.Cluster.NodeName, "--kubelet-root-dir", suite.Cluster.KubeletRootDir,
		"--allowed-base-paths", s.Work.BaseRoot)...)
	if err != nil {
		return fmt.Errorf("start node plugin: %w", err)
	}
	s.Daemons = append(s.Daemons, ctrlProc, nodeProc)
	if err := framework.WaitForDriverRegistered(ctx, suite.Client, suite.Cluster.NodeName, 60*time.Second); err != nil {
		return fmt.Errorf("node plugin registration: %w\n%s", err, nodeProc.Tail(3000))
	}
	return nil
}

// capacityNamespace holds the CSIStorageCapacity objects of the suite's dirpv processes, which
// run outside any pod and so outside dirpv's namespace.
const capacityNamespace = "dirpv-capacity"

// createCSIDriver creates the CSIDriver object deploy/ installs (no attach, storage capacity
// on), and the namespace the processes publish capacity in.
func createCSIDriver(ctx context.Context) error {
	d, err := framework.CSIDriverFromDeploy()
	if err != nil {
		return err
	}
	if _, err := suite.Client.StorageV1().CSIDrivers().Create(ctx, d, metav1.CreateOptions{}); err != nil {
		return err
	}
	_, err = suite.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: capacityNamespace}}, metav1.CreateOptions{})
	return err
}
