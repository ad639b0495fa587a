package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// createClaims creates n claims placed on node-a, in parallel as a kind e2e suite would.
func createClaims(t *testing.T, ns, class string, n int) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 16)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			c := newClaim(ns, fmt.Sprintf("c-%03d", i), class, onNode(nodeA))
			if _, err := client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// checkOneDirectoryPerPV waits until all n claims are Bound, then checks that every claim has
// its own PV, every PV its own directory, and the base holds nothing else.
func checkOneDirectoryPerPV(t *testing.T, ns, base string, n int, wait time.Duration) {
	t.Helper()
	err := framework.WaitForClaimsBound(context.Background(), client, ns, n, wait)
	if err != nil {
		t.Fatalf("%v\n--- node-a log tail:\n%s", err, nodeProc.Tail(3000))
	}
	pvs, err := client.CoreV1().PersistentVolumes().List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	paths := map[string]string{}
	claimed := map[string]bool{}
	for _, pv := range pvs.Items {
		if pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns {
			continue
		}
		key := pv.Spec.ClaimRef.Name
		if claimed[key] {
			t.Errorf("claim %s has two PVs", key)
		}
		claimed[key] = true
		p := pv.Spec.CSI.VolumeAttributes["path"]
		if other, dup := paths[p]; dup {
			t.Errorf("PVs %s and %s share directory %s", other, pv.Name, p)
		}
		paths[p] = pv.Name
	}
	if len(paths) != n {
		t.Errorf("%d PVs for %d claims", len(paths), n)
	}
	dirs := entries(t, base)
	if len(dirs) != n {
		t.Errorf("%d directories for %d PVs", len(dirs), n)
	}
	for _, d := range dirs {
		if _, ok := paths[d]; !ok {
			t.Errorf("orphan directory %s: no PV refers to it", d)
		}
	}
}

func TestTwoHundredClaimsAtOnce(t *testing.T) {
	ns := newNamespace(t)
	class, base := localClass(t, nil)
	start := time.Now()
	createClaims(t, ns, class.Name, 200)
	checkOneDirectoryPerPV(t, ns, base, 200, 3*time.Minute)
	t.Logf("200 claims created and Bound in %s", time.Since(start).Round(time.Millisecond))
}

// The node instance is killed while provisioning 100 claims and started again: every claim
// binds, and nothing is orphaned or doubled.
func TestKilledMidwayRecovers(t *testing.T) {
	ns := newNamespace(t)
	class, base := localClass(t, nil)
	createClaims(t, ns, class.Name, 100)
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		pvs, err := client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		mine := 0
		for _, pv := range pvs.Items {
			if pv.Spec.StorageClassName == class.Name {
				mine++
			}
		}
		return mine >= 10, fmt.Errorf("%d PVs so far", mine)
	})
	if err != nil {
		t.Fatal(err)
	}
	nodeProc.Kill()
	t.Logf("killed node-a with %d directories made", len(entries(t, base)))
	if err := nodeProc.Restart(); err != nil {
		t.Fatal(err)
	}
	checkOneDirectoryPerPV(t, ns, base, 100, 3*time.Minute)
}
