package daemon

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/record"
	"k8s.io/utils/ptr"
)

// Short timings so that a test takes a second, in the ratios of the defaults.
var testElection = LeaderElectionConfig{
	Enabled: true, Namespace: "kube-system",
	LeaseDuration: 3 * time.Second, RenewDeadline: 2 * time.Second, RetryPeriod: 100 * time.Millisecond,
}

type replica struct {
	cancel  context.CancelFunc
	leading chan struct{} // closed when lead starts
	stopped chan struct{} // closed when lead's context ends
	drain   chan struct{} // lead returns once this is closed
	result  chan error
}

func startReplica(client kubernetes.Interface) *replica {
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{cancel: cancel, leading: make(chan struct{}), stopped: make(chan struct{}),
		drain: make(chan struct{}), result: make(chan error, 1)}
	go func() {
		r.result <- runElected(ctx, client, testElection, &record.FakeRecorder{}, func(ctx context.Context) {
			close(r.leading)
			<-ctx.Done()
			close(r.stopped)
			<-r.drain
		})
	}()
	return r
}

func holder(t *testing.T, client kubernetes.Interface) string {
	t.Helper()
	l, err := client.CoordinationV1().Leases("kube-system").Get(context.Background(), leaseName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("read lease: %v", err)
	}
	return ptr.Deref(l.Spec.HolderIdentity, "")
}

func waitClosed(t *testing.T, ch chan struct{}, within time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(within):
		t.Fatalf("%s: not within %s", what, within)
	}
}

func waitResult(t *testing.T, r *replica, within time.Duration) error {
	t.Helper()
	select {
	case err := <-r.result:
		return err
	case <-time.After(within):
		t.Fatalf("runElected did not return within %s", within)
		return nil
	}
}

// A leader that is told to stop keeps the lease until its work has drained, then hands it
// over at once (well within the lease duration) and returns nil; a standby returns nil too,
// whether it led or not.
func TestRunElectedHandsOverAfterDrain(t *testing.T) {
	client := fake.NewClientset()
	a := startReplica(client)
	waitClosed(t, a.leading, 5*time.Second, "first replica leads")
	b := startReplica(client)
	leaderID := holder(t, client)
	// A standby that is stopped returns nil at once, without ever leading.
	c := startReplica(client)
	c.cancel()
	if err := waitResult(t, c, 2*time.Second); err != nil {
		t.Errorf("standby returned %v, want nil", err)
	}
	select {
	case <-c.leading:
		t.Error("the stopped standby led")
	default:
	}

	a.cancel()
	waitClosed(t, a.stopped, time.Second, "leader's work is told to stop")
	// While the old leader drains, the lease stays its own and the standby waits.
	for range 5 {
		select {
		case <-b.leading:
			t.Fatal("the standby started leading while the old leader was still draining")
		case <-time.After(testElection.RetryPeriod):
		}
		if h := holder(t, client); h != leaderID {
			t.Fatalf("lease holder is %q while the leader drains, want %q", h, leaderID)
		}
	}
	released := time.Now()
	close(a.drain)
	if err := waitResult(t, a, 5*time.Second); err != nil {
		t.Errorf("leader that was stopped returned %v, want nil", err)
	}
	waitClosed(t, b.leading, testElection.LeaseDuration, "standby takes over before the lease would expire")
	t.Logf("handover took %s after the leader drained (lease duration %s)", time.Since(released), testElection.LeaseDuration)

	b.cancel()
	close(b.drain)
	if err := waitResult(t, b, 5*time.Second); err != nil {
		t.Errorf("second leader returned %v, want nil", err)
	}
	if h := holder(t, client); h != "" {
		t.Errorf("lease still held by %q after every replica stopped", h)
	}
}

// A leader that cannot renew its lease while it runs (the API server refuses, as in a
// partition) stops its work and returns errLostLease without waiting for the work to drain, so
// that the process exits non-zero.
func TestRunElectedLosingTheLeaseIsAnError(t *testing.T) {
	client := fake.NewClientset()
	var partitioned atomic.Bool
	client.PrependReactor("update", "leases", func(k8stesting.Action) (bool, runtime.Object, error) {
		if partitioned.Load() {
			return true, nil, apierrors.NewServiceUnavailable("partitioned")
		}
		return false, nil, nil
	})
	a := startReplica(client)
	waitClosed(t, a.leading, 5*time.Second, "replica leads")
	partitioned.Store(true)
	waitClosed(t, a.stopped, testElection.RenewDeadline+2*time.Second, "work stops after the lease is lost")
	// a.drain stays open: the error must not wait for the work.
	err := waitResult(t, a, 5*time.Second)
	if !errors.Is(err, errLostLease) {
		t.Errorf("runElected returned %v, want %v", err, errLostLease)
	}
	close(a.drain)
}
