package integration

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// startNodeInstance creates a new Ready node and starts a dirpv node instance for it whose
// allowed base paths are bases, with the extra environment env (e.g. a failpoint), and returns
// it once healthy. Its stop, and the node's deletion, are the test's cleanups: a file system
// its bases are on must be made before, so that it is unmounted after the instance stopped.
func startNodeInstance(t *testing.T, node, bases string, env ...string) *framework.Process {
	t.Helper()
	createNode(t, node)
	return startNodeProcess(t, node, bases, nil, env...)
}

// createNode creates a Ready node, as a kubelet would, with the CSINode of a node that runs
// dirpv's plugin; deleting it is the test's cleanup.
func createNode(t *testing.T, node string) {
	t.Helper()
	ctx := context.Background()
	must(t, suite.Cluster.CreateReadyNode(ctx, node, map[string]string{"kubernetes.io/hostname": "host-" + node}))
	t.Cleanup(func() { suite.Client.CoreV1().Nodes().Delete(ctx, node, metav1.DeleteOptions{}) })
	must(t, suite.Cluster.RegisterCSIDriver(ctx, node, "dirpv.io"))
}

// startNodeProcess is startNodeInstance without the node, with the extra flags: it may be
// created later (createNode), or not at all.
func startNodeProcess(t *testing.T, node, bases string, flags []string, env ...string) *framework.Process {
	t.Helper()
	ctx := context.Background()
	proc, err := suite.StartDirpv(ctx, node, "node", append([]string{"--v=2", "--operation-timeout=10s",
		"--node-name", node, "--allowed-base-paths", bases,
		"--csi-endpoint", "unix://" + filepath.Join(t.TempDir(), "csi.sock"), "--plugin-registration-dir", "-"}, flags...)...)
	must(t, err)
	t.Cleanup(func() { proc.Stop(10 * time.Second) })
	if len(env) > 0 {
		proc.Kill()
		proc.Env = env
		must(t, proc.Restart())
	}
	must(t, proc.WaitHealthy(ctx, timeout))
	return proc
}

// waitHeldAt waits until the node instance's copy is held at point (a pausing failpoint).
func waitHeldAt(t *testing.T, proc *framework.Process, point string) {
	t.Helper()
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		return strings.Contains(proc.Tail(4000), "failpoint "+point+" reached"), errors.New("the copy did not reach the failpoint")
	})
	must(t, err, proc)
}

// waitKilledAt waits until proc has died at failpoint point: by SIGKILL, after logging that it
// reached the point, so that a test of the crash proves the crash happened there.
func waitKilledAt(t *testing.T, proc *framework.Process, point string) {
	t.Helper()
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		exited, _ := proc.Exited()
		return exited, errors.New("the node instance is still running")
	})
	must(t, err, proc)
	_, exitErr := proc.Exited()
	if !strings.Contains(proc.Tail(4000), "failpoint "+point+" reached") || exitErr == nil || !strings.Contains(exitErr.Error(), "killed") {
		t.Fatalf("the node instance exited (%v) but not at failpoint %s:\n%s", exitErr, point, proc.Tail(3000))
	}
}
