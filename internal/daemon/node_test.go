package daemon

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/dirpv/dirpv/provisioner"
)

// Without dirpv controller (nodes watch all volumes), the source of a local clone can still
// be deleted: the nodes remove the cloning finalizer once no Pending claim is cloned from it,
// every node at once without harm. With a controller, nodes leave that to it.
func TestNodesWithoutControllerReleaseClonedSource(t *testing.T) {
	now := metav1.Now()
	src := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{
		Namespace: "ns", Name: "src", DeletionTimestamp: &now,
		Finalizers: []string{provisioner.FinalizerCloningProtection, "kubernetes.io/pvc-protection"},
	}}
	client := fake.NewClientset(src)
	noop := func(context.Context) {}
	if got := nodeAlso(NodeConfig{}, client, newInformerFactory(client, 0), noop); len(got) != 1 {
		t.Errorf("with a controller, a node runs %d functions besides provisioning, want snapshots only", len(got))
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range 2 {
		factory := newInformerFactory(client, 0)
		fns := nodeAlso(NodeConfig{WatchAllVolumes: true, Provisioner: ProvisionerConfig{Workers: 4}}, client, factory, noop)
		factory.Start(ctx.Done())
		for _, fn := range fns {
			wg.Go(func() { fn(ctx) })
		}
		wg.Go(func() {
			<-ctx.Done()
			factory.Shutdown()
		})
	}
	var finalizers []string
	err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		c, err := client.CoreV1().PersistentVolumeClaims("ns").Get(ctx, "src", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		finalizers = c.Finalizers
		return !slices.Contains(finalizers, provisioner.FinalizerCloningProtection), nil
	})
	if err != nil {
		t.Fatalf("source claim's finalizers %v: the cloning finalizer was never removed: %v", finalizers, err)
	}
	if !slices.Equal(finalizers, []string{"kubernetes.io/pvc-protection"}) {
		t.Errorf("finalizers %v, want the other finalizer kept", finalizers)
	}
}
