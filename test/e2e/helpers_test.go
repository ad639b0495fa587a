package e2e

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

const timeout = 2 * time.Minute

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// waitPodPhase waits for the pod to reach phase.
func waitPodPhase(t *testing.T, ns, name string, phase v1.PodPhase) *v1.Pod {
	t.Helper()
	pod, err := framework.WaitForPodPhase(context.Background(), suite.Client, ns, name, phase, timeout)
	if err != nil {
		t.Fatalf("%v\n--- node plugin log tail:\n%s", err, nodeProc.Tail(3000))
	}
	return pod
}

// podLogs returns what the pod printed, through the API server and kubelet as kubectl logs does.
func podLogs(t *testing.T, ns, name string) string {
	t.Helper()
	b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &v1.PodLogOptions{}).DoRaw(context.Background())
	if err != nil {
		t.Fatalf("logs of %s/%s: %v", ns, name, err)
	}
	return string(b)
}

func deletePod(t *testing.T, ns, name string) {
	t.Helper()
	ctx := context.Background()
	must(t, suite.Client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}))
	must(t, framework.WaitForPodDeleted(ctx, suite.Client, ns, name, timeout))
}

func boundPV(t *testing.T, ns, claim string) *v1.PersistentVolume {
	t.Helper()
	pv, err := framework.WaitForBoundPV(context.Background(), suite.Client, ns, claim, timeout)
	must(t, err)
	return pv
}

// volumeTarget is where kubelet asks a CSI plugin to publish the pod's volume.
func volumeTarget(pod *v1.Pod, pvName string) string {
	return filepath.Join(suite.Cluster.KubeletRootDir, "pods", string(pod.UID), "volumes", "kubernetes.io~csi", pvName, "mount")
}

// mountsUnder lists mount points at or below dir.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	m, err := framework.MountsUnder(dir)
	must(t, err)
	return m
}

// waitNoMountsUnder waits until nothing is mounted at or below dir: kubelet unpublishes
// asynchronously after the pod object is gone.
func waitNoMountsUnder(t *testing.T, dir string) {
	t.Helper()
	if err := framework.WaitForNoMountsUnder(context.Background(), dir, timeout); err != nil {
		t.Fatalf("%v\n--- node plugin log tail:\n%s", err, nodeProc.Tail(3000))
	}
}
