// Command up installs dirpv from deploy/ into the local cluster that
// `go run ./test/cluster/cmd/dirpv-cluster up --node` started (this is `make up`'s second
// step), creates a demo claim and pod on the default class, and tells the user where the
// pod's data is on disk.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
)

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "make up:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	dir := os.Getenv("DIRPV_CLUSTER_DIR")
	if dir == "" {
		dir = "/tmp/dirpv-cluster"
	}
	c, err := cluster.LoadState(filepath.Join(dir, "state.json"), logf)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("no local cluster is up: run `make up` (or dirpv-cluster up --node) first")
	}
	if err != nil {
		return err
	}
	if c.NodeName == "" {
		return fmt.Errorf("the local cluster has no node: `make down`, then `make up`")
	}
	if _, err := framework.Install(ctx, c, logf); err != nil {
		return err
	}
	client, err := c.Client()
	if err != nil {
		return err
	}
	const ns, claim, pod = "default", "demo", "demo"
	pvc := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: ns},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Resources:   v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod, Namespace: ns},
		Spec: v1.PodSpec{
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []v1.Container{{
				Name: "demo", Image: c.BusyboxImage, ImagePullPolicy: v1.PullNever,
				Command:      []string{"sh", "-c", "date > /data/hello.txt; echo written by pod demo >> /data/hello.txt; exec sleep 2147483647"},
				VolumeMounts: []v1.VolumeMount{{Name: "data", MountPath: "/data"}},
			}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			}}},
		},
	}
	if _, err := client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	pv, err := framework.WaitForBoundPV(ctx, client, ns, claim, 2*time.Minute)
	if err != nil {
		return err
	}
	onDisk := filepath.Join(pv.Spec.CSI.VolumeAttributes["basePath"], pv.Spec.CSI.VolumeAttributes["path"], "hello.txt")
	err = framework.Poll(ctx, 2*time.Minute, func(ctx context.Context) (bool, error) {
		_, err := os.Stat(onDisk)
		return err == nil, err
	})
	if err != nil {
		return fmt.Errorf("the demo pod's file did not appear at %s: %w", onDisk, err)
	}
	fmt.Printf(`
dirpv is running on a local Kubernetes v1.37 (node %s), dirpv-local is the default StorageClass.

  export KUBECONFIG=%s
  kubectl get pods -n dirpv             # dirpv controller and node plugin
  kubectl get storageclass,pvc,pv
  cat %s    # the demo pod's file, on this host

Create your own claims without a storageClassName; local volumes live under /var/lib/dirpv.
Stop everything with: make down
`, c.NodeName, c.Kubeconfig, onDisk)
	return nil
}
