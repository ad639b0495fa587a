package daemon

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// serve runs the process's HTTP server on a free loopback address until the test ends, with
// healthy as its health check, and returns the address once it answers.
func serve(t *testing.T, cfg httpConfig, healthy func() error) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	cfg.address = l.Addr().String()
	l.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runAll(ctx, cfg, newRegistry(), healthy, func(ctx context.Context) error { <-ctx.Done(); return nil })
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runAll: %v", err)
		}
	})
	err = wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		resp, err := http.Get("http://" + cfg.address + "/metrics")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil, nil
	})
	if err != nil {
		t.Fatalf("the server at %s never answered: %v", cfg.address, err)
	}
	return cfg.address
}

// /healthz answers 503 with the reason while the process reports itself unhealthy, which is
// what makes kubelet's liveness probe restart it, and 200 again once it recovers.
// /debug/pprof/ is served only with --profiling: a heap profile is what tells where a
// process's memory goes, and is not something every scraper of /metrics should be able to pull.
func TestHealthzAndProfiling(t *testing.T) {
	var wedged atomic.Bool
	healthy := func() error {
		if wedged.Load() {
			return errors.New("NFS exports wedged")
		}
		return nil
	}
	get := func(addr, path string) (int, string) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, profiling := range []bool{false, true} {
		addr := serve(t, httpConfig{profiling: profiling}, healthy)
		want := map[bool]int{false: http.StatusNotFound, true: http.StatusOK}[profiling]
		if code, _ := get(addr, "/debug/pprof/heap"); code != want {
			t.Errorf("profiling=%v: /debug/pprof/heap answered %d, want %d", profiling, code, want)
		}
		if code, body := get(addr, "/healthz"); code != http.StatusOK {
			t.Errorf("healthy: /healthz answered %d %q, want 200", code, body)
		}
		wedged.Store(true)
		if code, body := get(addr, "/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "NFS exports wedged") {
			t.Errorf("unhealthy: /healthz answered %d %q, want 503 with the reason", code, body)
		}
		wedged.Store(false)
		if code, body := get(addr, "/healthz"); code != http.StatusOK {
			t.Errorf("recovered: /healthz answered %d %q, want 200", code, body)
		}
	}
}

// Both processes refuse to start on a kernel that lacks what volume operations need, with
// the probe's message, before they touch the API server or a socket.
func TestRefuseOldKernelAtStartup(t *testing.T) {
	tooOld := errors.New("kernel 5.4.0 is too old: dirpv needs Linux 5.8 or newer")
	orig := checkKernel
	checkKernel = func() error { return tooOld }
	t.Cleanup(func() { checkKernel = orig })
	for name, run := range map[string]func() error{
		"controller": func() error { return RunController(context.Background(), ControllerConfig{}) },
		"node":       func() error { return RunNode(context.Background(), NodeConfig{NodeName: "n"}) },
	} {
		if err := run(); !errors.Is(err, tooOld) {
			t.Errorf("%s started on an old kernel: %v", name, err)
		}
	}
}
