package integration

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/framework"
)

// TestFailuresAreRetriedPastTheLibsThreshold: a Provision and a Delete that keep failing are
// retried after their 15th failure, where the lib's default gives up, and succeed once what
// failed them is fixed; a refusal no retry can fix is not retried hot meanwhile (the lib used
// to retry it as any failure, with an event each time). The instance backs off from 10 ms to 100 ms (--retry-interval-*), so
// that twenty failures take a second or two instead of hours.
func TestFailuresAreRetriedPastTheLibsThreshold(t *testing.T) {
	const node = "node-retry"
	class, base := localClass(t, nil)
	// Its Node does not exist yet: Provision cannot read the node's hostname label for the
	// PV's node affinity, and fails (an API error, retried as any other failure).
	proc := startNodeProcess(t, node, base, []string{"--retry-interval-start=10ms", "--retry-interval-max=100ms"})
	ns := suite.NewNamespace(t)
	suite.CreateClaim(t, ns, "c", class.Name, framework.OnNode(node))
	waitFailures(t, proc, "dirpv_persistentvolumeclaim_provision_failed_total", class.Name, 20)
	createNode(t, node)
	_, pv := waitBound(t, ns, "c")

	// A refusal no retry can fix, on the same instance: the lib's slow-retry interval, not
	// the queue's short back-off, spaces its attempts. The Delete's failures below, every 10
	// to 100 ms, are the clock: the refused claim is back in the queue as often, and must not
	// have been provisioned again meanwhile.
	refused := suite.CreateClass(t, "retry-refused", map[string]string{"backend": "local", "basePath": base, "bsaePath": "/tmp"})
	suite.CreateClaim(t, ns, "refused", refused.Name, framework.OnNode(node))
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "refused", "ProvisioningFailed", "Retries will be delayed")
	if !strings.Contains(ev.Message, `"bsaePath"`) {
		t.Errorf("event %q does not name the unknown parameter", ev.Message)
	}

	// A file system mounted on the volume's directory: removing it fails (EBUSY), as it
	// would for a mount left behind by a pod.
	dir := filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"])
	if err := unix.Mount(t.TempDir(), dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount on %s: %v", dir, err)
	}
	mounted := true
	t.Cleanup(func() {
		if mounted {
			unix.Unmount(dir, unix.MNT_DETACH)
		}
	})
	deleteClaim(t, ns, "c")
	waitFailures(t, proc, "dirpv_persistentvolume_delete_failed_total", class.Name, 20)
	if n := failures(t, proc, "dirpv_persistentvolumeclaim_provision_failed_total", refused.Name); n != 1 {
		t.Errorf("the refused claim was provisioned %v times while the Delete failed 20 times: it is retried hot", n)
	}
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatalf("unmount %s: %v", dir, err)
	}
	mounted = false
	waitPVGone(t, pv.Name)
	if got := entries(t, base); len(got) != 0 {
		t.Errorf("deleted volume left %v in the base", got)
	}
}

// failures returns the failures proc's lib metric counts for class.
func failures(t *testing.T, proc *framework.Process, metric, class string) float64 {
	t.Helper()
	m, err := framework.Scrape(context.Background(), proc)
	must(t, err)
	return sumClass(m, metric, class)
}

func sumClass(m map[string]float64, metric, class string) float64 {
	var sum float64
	for k, v := range m {
		if strings.HasPrefix(k, metric+"{") && strings.Contains(k, fmt.Sprintf("class=%q", class)) {
			sum += v
		}
	}
	return sum
}

// waitFailures waits until proc's lib metric counts at least n failures for class.
func waitFailures(t *testing.T, proc *framework.Process, metric, class string, n float64) {
	t.Helper()
	var got float64
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		m, err := framework.Scrape(ctx, proc)
		if err != nil {
			return false, err
		}
		got = sumClass(m, metric, class)
		return got >= n, fmt.Errorf("%s counts %v failures, want at least %v: retries stopped", metric, got, n)
	})
	must(t, err, proc)
	t.Logf("%s: %v failures", metric, got)
}
