package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// createClaims creates n claims c-000, c-001... in parallel as a kind e2e suite would.
func createClaims(t *testing.T, ns, class string, n int, opts ...framework.ClaimOption) {
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
			c := framework.NewClaim(ns, fmt.Sprintf("c-%03d", i), class, opts...)
			if _, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), c, metav1.CreateOptions{}); err != nil {
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
// exactly one PV, every PV its own directory, and the base holds nothing else.
func checkOneDirectoryPerPV(t *testing.T, ns, base string, n int, wait time.Duration) {
	t.Helper()
	ctx := context.Background()
	err := framework.WaitForClaimsBound(ctx, suite.Client, ns, n, wait)
	must(t, err, nodeProc)
	problems, err := framework.CheckOnePVPerClaim(ctx, suite.Client, ns, entries(t, base))
	must(t, err)
	for _, p := range problems {
		t.Error(p)
	}
}

func TestTwoHundredClaimsAtOnce(t *testing.T) {
	ns := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	start := time.Now()
	createClaims(t, ns, class.Name, 200, framework.OnNode(nodeA))
	checkOneDirectoryPerPV(t, ns, base, 200, 3*time.Minute)
	t.Logf("200 claims created and Bound in %s", time.Since(start).Round(time.Millisecond))
}

// blockPVsOf makes the API server refuse PVs of the held claims of ns until the returned
// function is called (also at cleanup). Their Provision then makes the directory and fails to
// store the PV, so that a kill always finds their directories made and their PVs missing: the
// crash window between mkdir and PV creation, hit on every run rather than by luck.
func blockPVsOf(t *testing.T, ns string, held []string) func() {
	t.Helper()
	unblock, err := framework.BlockPVCreation(context.Background(), suite.Client, ns, held)
	must(t, err)
	done := false
	lift := func() {
		if done {
			return
		}
		done = true
		must(t, unblock(context.Background()))
	}
	t.Cleanup(lift)
	return lift
}

// dirsOf lists the names among dirs made for the claims (the default pattern starts with
// namespace-claim-).
func dirsOf(ns string, claims, dirs []string) []string {
	var out []string
	for _, d := range dirs {
		for _, c := range claims {
			if strings.HasPrefix(d, ns+"-"+c+"-") {
				out = append(out, d)
			}
		}
	}
	return out
}

// checkKilledMidway fails unless the kill came in the middle: some claims but not all were
// Bound, and every held claim had its directory and no PV.
func checkKilledMidway(t *testing.T, ns string, snap *framework.KillSnapshot, n int, held []string) {
	t.Helper()
	t.Logf("killed with %d of %d claims Bound, %d directories, %d PVs", snap.Bound, n, len(snap.Dirs), len(snap.PVPaths))
	if snap.Total != n || snap.Bound == 0 || snap.Bound >= n {
		t.Fatalf("the kill was not mid-way: %d of %d claims Bound at the kill (%d claims), want some but not all", snap.Bound, n, snap.Total)
	}
	if got := dirsOf(ns, held, snap.Names()); len(got) != len(held) {
		t.Fatalf("directories of the held claims at the kill: %v, want one each of %v", got, held)
	}
}

// checkAdopted fails unless each held claim is bound to the very directory its killed attempt
// made.
func checkAdopted(t *testing.T, ns string, snap *framework.KillSnapshot, held []string) {
	t.Helper()
	problems, err := snap.CheckAdopted(context.Background(), suite.Client, ns, held)
	must(t, err)
	for _, p := range problems {
		t.Error(p)
	}
}

// The node instance is SIGKILLed while provisioning 100 claims and started again: the kill
// comes mid-way (some claims Bound, not all), the held claims' retried Provision adopts the
// directory the killed attempt made, every claim binds with exactly one PV and nothing on disk
// is orphaned.
func TestKilledMidwayRecovers(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	const n = 100
	held := []string{"c-000", "c-001", "c-002"}
	lift := blockPVsOf(t, ns, held)
	createClaims(t, ns, class.Name, n, framework.OnNode(nodeA))
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		bound, _, err := framework.BoundClaims(ctx, suite.Client, ns)
		if err != nil {
			return false, err
		}
		made := dirsOf(ns, held, entries(t, base))
		return bound >= 10 && len(made) == len(held), fmt.Errorf("%d claims Bound, held claims' directories %v", bound, made)
	})
	must(t, err, nodeProc)
	// Later tests need node-a, even if this one fails half-way.
	t.Cleanup(func() {
		if exited, _ := nodeProc.Exited(); exited {
			nodeProc.Restart()
		}
	})
	nodeProc.Kill()
	snap, err := framework.TakeKillSnapshot(ctx, suite.Client, ns, base, func(string) bool { return true })
	must(t, err)
	checkKilledMidway(t, ns, snap, n, held)
	lift()
	must(t, nodeProc.Restart())
	checkOneDirectoryPerPV(t, ns, base, n, 3*time.Minute)
	checkAdopted(t, ns, snap, held)
}
