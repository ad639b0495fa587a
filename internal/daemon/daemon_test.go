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

// freeAddr returns a loopback address whose port is free now.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// /healthz answers 503 with the reason while the process reports itself unhealthy, which is
// what makes kubelet's liveness probe restart it, and 200 again once it recovers.
func TestHealthzFollowsTheHealthCheck(t *testing.T) {
	addr := freeAddr(t)
	var wedged atomic.Bool
	healthy := func() error {
		if wedged.Load() {
			return errors.New("NFS exports wedged")
		}
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- runAll(ctx, httpConfig{address: addr}, newRegistry(), healthy, func(ctx context.Context) error { <-ctx.Done(); return nil })
	}()
	get := func() (int, string) {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	var code int
	var body string
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		code, body = get()
		return code == http.StatusOK, nil
	})
	if err != nil {
		t.Fatalf("/healthz never answered 200: %d %s", code, body)
	}
	wedged.Store(true)
	if code, body = get(); code != http.StatusServiceUnavailable || !strings.Contains(body, "NFS exports wedged") {
		t.Errorf("unhealthy: /healthz answered %d %q, want 503 with the reason", code, body)
	}
	wedged.Store(false)
	if code, body = get(); code != http.StatusOK {
		t.Errorf("recovered: /healthz answered %d %q, want 200", code, body)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("runAll: %v", err)
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

// /debug/pprof/ is served only with --profiling: a heap profile is what tells where a
// process's memory goes, and is not something every scraper of /metrics should be able to pull.
func TestProfilingOnlyWhenAsked(t *testing.T) {
	for _, profiling := range []bool{false, true} {
		addr := freeAddr(t)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- runAll(ctx, httpConfig{address: addr, profiling: profiling}, newRegistry(), nil,
				func(ctx context.Context) error { <-ctx.Done(); return nil })
		}()
		var code int
		err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
			resp, err := http.Get("http://" + addr + "/debug/pprof/heap")
			if err != nil {
				return false, nil
			}
			resp.Body.Close()
			code = resp.StatusCode
			return true, nil
		})
		if err != nil {
			t.Fatalf("profiling=%v: server never answered: %v", profiling, err)
		}
		if want := map[bool]int{false: http.StatusNotFound, true: http.StatusOK}[profiling]; code != want {
			t.Errorf("profiling=%v: /debug/pprof/heap answered %d, want %d", profiling, code, want)
		}
		cancel()
		if err := <-done; err != nil {
			t.Errorf("runAll: %v", err)
		}
	}
}
