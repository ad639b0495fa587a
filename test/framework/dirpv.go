package framework

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// FreeAddr returns a loopback address whose port is free now.
func FreeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// StartDirpv runs `dirpv <subcommand> args...` with /healthz and /metrics on a free loopback
// port (Process.HTTPAddr) and waits until it reports healthy.
func StartDirpv(ctx context.Context, binary, name, logDir, subcommand string, args ...string) (*Process, error) {
	return StartDirpvEnv(ctx, nil, binary, name, logDir, subcommand, args...)
}

// StartDirpvEnv is StartDirpv with env added to the process's environment at every start.
func StartDirpvEnv(ctx context.Context, env []string, binary, name, logDir, subcommand string, args ...string) (*Process, error) {
	addr, err := FreeAddr()
	if err != nil {
		return nil, err
	}
	p, err := StartEnv(env, binary, name, logDir, append([]string{subcommand, "--http-address", addr}, args...)...)
	if err != nil {
		return nil, err
	}
	p.HTTPAddr = addr
	if err := p.WaitHealthy(ctx, 60*time.Second); err != nil {
		p.Stop(5 * time.Second)
		return nil, err
	}
	return p, nil
}

// WaitHealthy polls the process's /healthz until it answers 200, failing at once if the process
// exits.
func (p *Process) WaitHealthy(ctx context.Context, timeout time.Duration) error {
	url := "http://" + p.HTTPAddr + "/healthz"
	hc := &http.Client{Timeout: 2 * time.Second}
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		if exited, err := p.Exited(); exited {
			return false, fmt.Errorf("%s exited: %v", p.Name, err)
		}
		resp, err := hc.Get(url)
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, fmt.Errorf("%s: %s", url, resp.Status)
	})
	if err != nil {
		return fmt.Errorf("%s not healthy: %w\n--- log tail:\n%s", p.Name, err, p.Tail(3000))
	}
	return nil
}

// Cleanups runs registered functions once, last registered first, either when Run is called
// or when the test binary gets SIGINT or SIGTERM, so an interrupted run leaves no cluster,
// server or mount behind.
type Cleanups struct {
	mu   sync.Mutex
	fns  []func()
	done bool
}

// NewCleanups returns Cleanups that also run on SIGINT/SIGTERM, then exit with status 1.
func NewCleanups() *Cleanups {
	c := &Cleanups{}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		s := <-sig
		fmt.Fprintf(os.Stderr, "got %s: cleaning up\n", s)
		c.Run()
		os.Exit(1)
	}()
	return c
}

// Add registers fn.
func (c *Cleanups) Add(fn func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.fns = append(c.fns, fn)
}

// Run runs the registered functions once.
func (c *Cleanups) Run() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		return
	}
	c.done = true
	for i := len(c.fns) - 1; i >= 0; i-- {
		c.fns[i]()
	}
}

// Scrape reads a dirpv process's /metrics and returns each sample's value by its series as
// written there, e.g. `dirpv_nfs_exports_mounted` or `name{label="v"}`.
func Scrape(ctx context.Context, p *Process) (map[string]float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.HTTPAddr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", p.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: %s", p.Name, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		i := strings.LastIndexByte(line, ' ')
		if strings.HasPrefix(line, "#") || i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return nil, fmt.Errorf("scrape %s: line %q: %w", p.Name, line, err)
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("scrape %s: %w", p.Name, err)
	}
	return out, nil
}
