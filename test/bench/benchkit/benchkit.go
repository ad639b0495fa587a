// Package benchkit holds what make bench's two sides share: test/bench on the host, and the
// guest-side rows of the VM tiers (test/vm/node's NFS bench, test/vm/kernel's copy bench).
// The same measurement is written once, here, so that the host's rows and the guest's compare
// like with like: the ideal external provisioner, the binding ceiling, the claim and PV
// watches that time them, the CSI publish cycle, the copy tree, the rows and their statistics.
package benchkit

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/framework"
)

// Parallelism is how many creates or deletes a bench has in flight, as a kind e2e suite
// creating claims would, and dirpv's --worker-threads default.
const Parallelism = 16

// Row is one measured figure with its reference, as test/bench prints it and writes it to
// its JSON report.
type Row struct {
	Name     string  `json:"name"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Ref      string  `json:"ref,omitempty"`
	RefValue float64 `json:"refValue,omitempty"`
	Ratio    float64 `json:"ratio,omitempty"`
	Note     string  `json:"note,omitempty"`
}

// Line sets r's ratio to its reference and formats it as a progress line, its name padded
// to width.
func (r *Row) Line(width int) string {
	if r.RefValue > 0 {
		r.Ratio = r.Value / r.RefValue
	}
	ratio := ""
	if r.Ratio > 0 {
		ratio = fmt.Sprintf("  (%.2fx %s)", r.Ratio, r.Ref)
	}
	return fmt.Sprintf("%-*s %10.2f %-5s%s", width, r.Name, r.Value, r.Unit, ratio)
}

// GuestReport is what a guest-side bench hands test/bench: its rows, and its figures (and
// notes) by name for test/bench's goals.
type GuestReport struct {
	N        int                `json:"n,omitempty"`
	PublishN int                `json:"publishN,omitempty"`
	Seconds  float64            `json:"seconds,omitempty"`
	Rows     []Row              `json:"rows,omitempty"`
	Figures  map[string]float64 `json:"figures"`
	Notes    map[string]string  `json:"notes,omitempty"`
}

// Parallel runs fn(i) for i in [0,n), k at a time, and returns the first error.
func Parallel(n, k int, fn func(i int) error) error {
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	next := make(chan int)
	for range k {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := fn(i); err != nil {
					once.Do(func() { first = err })
				}
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return first
}

// timed runs fn iters times after one unmeasured run (connection set-up, first mount of an
// export) and returns each measured run's time.
func timed(iters int, fn func() error) ([]time.Duration, error) {
	var out []time.Duration
	for i := -1; i < iters; i++ {
		t0 := time.Now()
		if err := fn(); err != nil {
			return nil, err
		}
		if i >= 0 {
			out = append(out, time.Since(t0))
		}
	}
	return out, nil
}

// Rounds times each of fns per times (Timed), in rounds, one fn after the other, so that load
// from elsewhere on the machine hits them all alike; out[i] are fns[i]'s times.
func Rounds(rounds, per int, fns ...func() error) ([][]time.Duration, error) {
	out := make([][]time.Duration, len(fns))
	for range max(1, rounds) {
		for i, fn := range fns {
			ds, err := timed(max(1, per), fn)
			if err != nil {
				return nil, err
			}
			out[i] = append(out[i], ds...)
		}
	}
	return out, nil
}

// Percentile returns the p-th percentile (0..100) of ds by nearest rank.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	return s[min(max(int(p/100*float64(len(s))+0.999999)-1, 0), len(s)-1)]
}

// MS is d in milliseconds.
func MS(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Median of vs (not empty); vs is sorted in place.
func Median(vs []float64) float64 {
	slices.Sort(vs)
	if m := len(vs) / 2; len(vs)%2 == 0 {
		return (vs[m-1] + vs[m]) / 2
	}
	return vs[len(vs)/2]
}

// Metrics reads a Prometheus text exposition at url and returns each sample's value by its
// series as written there, e.g. `go_memstats_heap_inuse_bytes` or `x_count{a="b"}`.
func Metrics(ctx context.Context, url string) (map[string]float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return ParseMetrics(string(b)), nil
}

// ParseMetrics is Metrics' parser: series -> value of each sample line of text.
func ParseMetrics(text string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		i := strings.LastIndexByte(line, ' ')
		if strings.HasPrefix(line, "#") || i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}

// Sum sums the samples of m (Metrics) of metric name whose labels include every one of
// labels (e.g. `verb="WATCH"`); a metric whose name merely starts with name does not count.
func Sum(m map[string]float64, name string, labels ...string) float64 {
	var sum float64
	for series, v := range m {
		rest, ok := strings.CutPrefix(series, name)
		if !ok || (rest != "" && rest[0] != '{') {
			continue
		}
		all := true
		for _, l := range labels {
			all = all && strings.Contains(rest, l)
		}
		if all {
			sum += v
		}
	}
	return sum
}

// UsedMiB is the space used on the file system of dir, from statfs.
func UsedMiB(dir string) (float64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return float64((st.Blocks-st.Bfree)*uint64(st.Bsize)) / (1 << 20), nil
}

// FillTree makes dir with the shape of test/bench's plain-copy tree (1 GiB, 10,000 small and
// 100,000 empty files at full size), for the VM's NFS copy bench: one file of bigBytes of
// data, small files of 4 to 64 KiB under small/, empty files under empty/. The data is random,
// each file its own: files with the same bytes would compress in a tar.gz stream, where each
// lies within gzip's window of the one before.
func FillTree(dir string, bigBytes int64, small, empty int) error {
	if err := framework.WriteDataFiles(dir, 1, bigBytes); err != nil {
		return err
	}
	rng, buf := rand.NewChaCha8([32]byte{2}), make([]byte, 64<<10)
	for sub, n := range map[string]int{"small": small, "empty": empty} {
		if err := os.Mkdir(filepath.Join(dir, sub), 0o755); err != nil {
			return err
		}
		for i := range n {
			size := 0
			if sub == "small" {
				size = 4<<10 + (i*7919)%(60<<10)
			}
			_, _ = rng.Read(buf[:size]) // never fails
			if err := os.WriteFile(filepath.Join(dir, sub, fmt.Sprintf("f%06d", i)), buf[:size], 0o644); err != nil {
				return err
			}
		}
	}
	return nil
}
