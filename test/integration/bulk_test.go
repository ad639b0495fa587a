package integration

import (
	"context"
	"strings"
	"sync"
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
	// Not sync.OnceFunc: it turns must's t.Fatal (runtime.Goexit) into a panic.
	var once sync.Once
	lift := func() { once.Do(func() { must(t, unblock(context.Background())) }) }
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
