package node_test

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm"
	"github.com/dirpv/dirpv/test/vm/node"
)

// installTimeout bounds dirpv's install from deploy/ until its node plugin has registered:
// two Go programs starting in the VM's emulation.
const installTimeout = 10 * time.Minute

var (
	suite     *framework.Suite
	guestNode *node.Node
	// stopErr is the guest node's stop, which runs in the suite's cleanup after the tests:
	// an agent that did not end cleanly fails the run.
	stopErr error
)

func TestMain(m *testing.M) {
	os.Exit(node.Main(m, func() int {
		code := framework.RunSuite(m, framework.SuiteOptions{
			Name:    "vmnode",
			Cluster: cluster.Options{Address: node.HostAddr, Logf: klog.Infof, ControllerManagerArgs: kcmArgs()},
		}, setup)
		if stopErr != nil {
			fmt.Fprintf(os.Stderr, "FAIL: %v\n", stopErr)
			code = 1
		}
		return code
	}))
}

// kcmArgs are kube-controller-manager's extra flags: test/bench's client limits when the run is
// make bench's NFS phase (TestBenchNFS), else none.
func kcmArgs() []string {
	if os.Getenv(benchEnv) != "" {
		return benchKCMArgs
	}
	return nil
}

// setup boots the guest and waits for its node, the control plane being the suite's.
func setup(ctx context.Context, s *framework.Suite) error {
	suite = s
	img, err := vm.Prepare(ctx, os.Stderr)
	if err != nil {
		return err
	}
	// The node imports dirpv's image as it starts, as a node with a registry would have pulled it.
	dirpvTar, dirpvImage, err := framework.BuildDirpvImage(ctx)
	if err != nil {
		return err
	}
	if guestNode, err = node.Start(ctx, node.Options{Cluster: s.Cluster, Image: img, Images: []string{dirpvTar}, NFS: true, Disks: true, Output: os.Stderr}); err != nil {
		return err
	}
	// Pods of suite.BusyboxPod run the busybox image the guest node imported.
	s.Cluster.BusyboxImage = cluster.BusyboxImage
	s.Cleanups.Add(func() {
		start := time.Now()
		_, stopErr = guestNode.Stop()
		fmt.Fprintf(os.Stderr, "VM node stopped in %s\n", time.Since(start).Round(time.Second))
	})
	fmt.Fprintf(os.Stderr, "VM node %s: guest booted in %s, node Ready %s after the guest's start\n",
		guestNode.Name, guestNode.Boot.Round(time.Second), guestNode.Ready.Round(time.Second))
	if _, err := framework.InstallImage(ctx, s.Cluster, dirpvImage, guestNode.Name, installTimeout, klog.Infof,
		"--quota-check-period="+quotaCheckPeriod.String()); err != nil {
		return fmt.Errorf("install dirpv: %w", err)
	}
	// The scheduler places a claim of a WaitForFirstConsumer class on the node only once
	// the node plugin has published the class's CSIStorageCapacity there; a pod that comes
	// first is retried on an event, or after minutes.
	return framework.Poll(ctx, installTimeout, func(ctx context.Context) (bool, error) {
		caps, err := s.Client.StorageV1().CSIStorageCapacities("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range caps.Items {
			if c.StorageClassName == "dirpv-local" && c.NodeTopology != nil && c.NodeTopology.MatchLabels["kubernetes.io/hostname"] == guestNode.Name {
				return true, nil
			}
		}
		return false, fmt.Errorf("no CSIStorageCapacity of dirpv-local for node %s among %d", guestNode.Name, len(caps.Items))
	})
}

// newNamespace is suite.NewNamespace once the namespace's default ServiceAccount exists: pods
// are refused until it does.
func newNamespace(ctx context.Context, t *testing.T) string {
	t.Helper()
	ns := suite.NewNamespace(t)
	if err := framework.Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
		_, err := suite.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, err
	}); err != nil {
		t.Fatal(err)
	}
	return ns
}

// createPods creates the pods.
func createPods(ctx context.Context, t *testing.T, pods ...*corev1.Pod) {
	t.Helper()
	for _, p := range pods {
		if _, err := suite.Client.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// createPod creates a busybox pod on the guest node that runs script with claim at /data.
func createPod(ctx context.Context, t *testing.T, ns, name, claim, script string) {
	t.Helper()
	createPods(ctx, t, suite.BusyboxPod(ns, name, claim, script, false))
}

// podOutput waits up to timeout for the pod to succeed and returns its log.
func podOutput(ctx context.Context, t *testing.T, ns, name string, timeout time.Duration) string {
	t.Helper()
	if _, err := framework.WaitForPodPhase(ctx, suite.Client, ns, name, corev1.PodSucceeded, timeout); err != nil {
		t.Fatalf("%v\nlog: %s\nevents:%s", err, podLog(ctx, ns, name), framework.EventsOf(ctx, suite.Client, ns, "Pod", name))
	}
	return podLog(ctx, ns, name)
}

func podLog(ctx context.Context, ns, name string) string {
	b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
}

// waitForLog waits up to timeout until the running pod's log holds line, a whole line, and
// returns the log.
func waitForLog(ctx context.Context, t *testing.T, ns, name, line string, timeout time.Duration) string {
	t.Helper()
	var log string
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			return false, err
		}
		log = string(b)
		return regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(line) + `$`).MatchString(log), fmt.Errorf("no line %q in the log yet", line)
	})
	if err != nil {
		t.Fatalf("pod %s/%s: %v; log:\n%s\nevents:%s", ns, name, err, log, framework.EventsOf(ctx, suite.Client, ns, "Pod", name))
	}
	return log
}
