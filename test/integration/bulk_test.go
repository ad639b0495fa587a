package integration

import (
	"context"
	"strings"
	"testing"

	"github.com/dirpv/dirpv/test/framework"
)

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
