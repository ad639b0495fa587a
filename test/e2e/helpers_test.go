package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/framework"
)

const timeout = 2 * time.Minute

func newNamespace(t *testing.T) string {
	t.Helper()
	ns, err := client.CoreV1().Namespaces().Create(context.Background(),
		&v1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "e2e-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		client.CoreV1().Namespaces().Delete(context.Background(), ns.Name, metav1.DeleteOptions{})
	})
	return ns.Name
}

// createClass creates a StorageClass deleted after the test.
func createClass(t *testing.T, name string, params map[string]string, lateBinding bool, mountOptions ...string) *storagev1.StorageClass {
	t.Helper()
	c := &storagev1.StorageClass{
		ObjectMeta:   metav1.ObjectMeta{Name: name},
		Provisioner:  "dirpv.io",
		Parameters:   params,
		MountOptions: mountOptions,
	}
	if lateBinding {
		c.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	}
	c, err := client.StorageV1().StorageClasses().Create(context.Background(), c, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		client.StorageV1().StorageClasses().Delete(context.Background(), c.Name, metav1.DeleteOptions{})
	})
	return c
}

func createClaim(t *testing.T, ns, name, class string, mode v1.PersistentVolumeAccessMode) {
	t.Helper()
	c := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PersistentVolumeClaimSpec{
			StorageClassName: &class,
			AccessModes:      []v1.PersistentVolumeAccessMode{mode},
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// podSpec is a busybox pod running script with the claim mounted at /data.
func podSpec(ns, name, claim, script string, readOnly bool) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			RestartPolicy:                 v1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []v1.Container{{
				Name:            "c",
				Image:           testCluster.BusyboxImage,
				ImagePullPolicy: v1.PullNever,
				Command:         []string{"sh", "-c", script},
				VolumeMounts:    []v1.VolumeMount{{Name: "data", MountPath: "/data"}},
			}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim, ReadOnly: readOnly},
			}}},
		},
	}
}

func createPod(t *testing.T, pod *v1.Pod) *v1.Pod {
	t.Helper()
	pod, err := client.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// waitPodPhase waits for the pod to reach phase; a pod that ends in another terminal phase
// fails the test at once with its status.
func waitPodPhase(t *testing.T, ns, name string, phase v1.PodPhase) *v1.Pod {
	t.Helper()
	var pod *v1.Pod
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		var err error
		if pod, err = client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return false, err
		}
		return pod.Status.Phase == phase, fmt.Errorf("pod %s/%s is %s: %+v", ns, name, pod.Status.Phase, pod.Status.ContainerStatuses)
	})
	if err != nil {
		t.Fatalf("%v\n--- node plugin log tail:\n%s", err, nodeProc.Tail(3000))
	}
	return pod
}

// podLogs returns what the pod printed, through the API server and kubelet as kubectl logs does.
func podLogs(t *testing.T, ns, name string) string {
	t.Helper()
	b, err := client.CoreV1().Pods(ns).GetLogs(name, &v1.PodLogOptions{}).DoRaw(context.Background())
	if err != nil {
		t.Fatalf("logs of %s/%s: %v", ns, name, err)
	}
	return string(b)
}

func deletePod(t *testing.T, ns, name string) {
	t.Helper()
	ctx := context.Background()
	if err := client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForPodDeleted(ctx, client, ns, name, timeout); err != nil {
		t.Fatal(err)
	}
}

func boundPV(t *testing.T, ns, claim string) *v1.PersistentVolume {
	t.Helper()
	pv, err := framework.WaitForBoundPV(context.Background(), client, ns, claim, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return pv
}

// volumeTarget is where kubelet asks a CSI plugin to publish the pod's volume.
func volumeTarget(pod *v1.Pod, pvName string) string {
	return filepath.Join(testCluster.KubeletRootDir, "pods", string(pod.UID), "volumes", "kubernetes.io~csi", pvName, "mount")
}

// mountsUnder lists mount points at or below dir.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	m, err := framework.MountsUnder(dir)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// waitNoMountsUnder waits until nothing is mounted at or below dir: kubelet unpublishes
// asynchronously after the pod object is gone.
func waitNoMountsUnder(t *testing.T, dir string) {
	t.Helper()
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		m := mountsUnder(t, dir)
		return len(m) == 0, fmt.Errorf("still mounted: %v", m)
	})
	if err != nil {
		t.Fatalf("%v\n--- node plugin log tail:\n%s", err, nodeProc.Tail(3000))
	}
}
