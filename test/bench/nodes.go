package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/framework"
)

var (
	flagNodes      = flag.String("nodes", "10,50", "nodes phase: comma-separated numbers of simulated nodes, each a fake Ready Node with its own `dirpv node` process")
	flagNodeClaims = flag.Int("node-claims", 4, "nodes phase: claims (each with a pod the scheduler places) per simulated node, so the cluster's volumes grow with N as on a real cluster")
)

const (
	// simLabel marks the simulated nodes; the phase's pods select it, so that the scheduler
	// never places one on the bench's own node, which has no process of this phase.
	simLabel = "dirpv.io/bench-sim"
	// nodesClass is the phase's local class. All node instances share its base directory:
	// a class has one basePath, and a pathPattern cannot name the node (the selected-node
	// annotation's key has a "/", which a pattern refuses).
	nodesClass = "bench-nodes"
)

// nodesResult is one N of the nodes phase.
type nodesResult struct {
	N, Claims int
	// Med, Max and Total are, by figure (nodeCounts'), its median over the node instances,
	// its most on one, and its sum over all. The scheduler packs the phase's pods (they never
	// run, so its spreading scores see no load), so the median node may cache nothing: the
	// total, against the claims and PVs there are, says whether each node caches only its own.
	Med, Max, Total map[string]float64
	// API server: WATCH requests open (all clients, and the N node instances' share), its RSS.
	Watches, WatchesBefore  float64
	APIRSSMiB, APIRSSBefore float64
	// APICPU is the API server's CPU seconds from the first node process's start to the
	// measurement.
	APICPU                   float64
	BoundSeconds, ClaimsPerS float64
	// Spread is the fewest and most claims the scheduler put on one node.
	SpreadMin, SpreadMax int
}

// parseNodeCounts parses -nodes: positive, distinct, ascending (each N adds nodes to the
// previous N's, and a fake node without its process must never exist while pods are placed).
func parseNodeCounts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("-nodes %q: %q is not a positive number", s, f)
		}
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-nodes %q: no node count", s)
	}
	sort.Ints(out)
	return out, nil
}

func simNodeName(i int) string { return fmt.Sprintf("sim-%03d", i) }

// nodes simulates a large cluster: for each N of -nodes, N fake Ready nodes each with its own
// `dirpv node` process (own node name, CSI socket, registration dir and metrics port; one
// base directory on one btrfs for all), one `dirpv controller`, and -node-claims claims per
// node placed by the real scheduler through pods that never run. It reports, per N, what one
// node instance costs and what the API server carries, and how both grow with N.
func (b *bench) nodes() error {
	counts, err := parseNodeCounts(*flagNodes)
	if err != nil {
		return err
	}
	dir := filepath.Join(b.s.Work.Dir, "sim")
	base := filepath.Join(dir, "base")
	// Mounted before any node process starts, so that cleanup (last registered first)
	// unmounts it only once they have all stopped.
	// Larger than a claim (1Gi), as dirpv refuses a volume larger than the free space.
	if err := b.s.MountBtrfs(base, 4<<30, false); err != nil {
		return err
	}
	if b.ctrl == nil {
		if b.ctrl, err = b.s.StartDirpvBin(b.ctx, b.ctrlBin, "controller-sim", "controller",
			append([]string{"--work-dir", filepath.Join(dir, "controller"), "--leader-election=false"}, b.common...)...); err != nil {
			return err
		}
	}
	if err := b.createClass(framework.NewClass(nodesClass, map[string]string{"backend": "local", "basePath": base})); err != nil {
		return err
	}
	made := 0
	defer b.deleteSimNodes(&made)
	var results []nodesResult
	for _, n := range counts {
		for ; made < n; made++ {
			name := simNodeName(made)
			if err := b.s.Cluster.CreateReadyNode(b.ctx, name, map[string]string{simLabel: "true"}); err != nil {
				return err
			}
			if err := b.s.Cluster.RegisterCSIDriver(b.ctx, name, "dirpv.io"); err != nil {
				return err
			}
		}
		t0 := time.Now()
		r, err := b.simulate(n, dir, base)
		if err != nil {
			return fmt.Errorf("%d nodes: %w", n, err)
		}
		fmt.Printf("   (N=%d done in %s)\n", n, time.Since(t0).Round(time.Second))
		results = append(results, r)
		b.addNodesRows(r)
	}
	printNodesTable(results)
	b.nodesGrowth(results)
	return nil
}

// simulate runs one N: it starts the node processes, provisions, measures, and removes the
// claims and the processes again, so that the next N starts from the same empty cluster.
func (b *bench) simulate(n int, dir, base string) (r nodesResult, err error) {
	r = nodesResult{N: n, Claims: n * *flagNodeClaims}
	if r.WatchesBefore, r.APIRSSBefore, err = b.apiServerLoad(); err != nil {
		return r, err
	}
	apiCPU0 := b.apiServerCPU()
	procs := make([]*framework.Process, n)
	defer func() {
		// Stopped in parallel: one by one, SIGTERM and exit take most of a second each.
		_ = benchkit.Parallel(n, benchkit.Parallelism, func(i int) error {
			if procs[i] != nil {
				procs[i].Stop(10 * time.Second)
			}
			return nil
		})
	}()
	start := func(i int) error {
		name := simNodeName(i)
		own := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Join(own, "registry"), 0o755); err != nil {
			return err
		}
		p, err := b.s.StartDirpvBin(b.ctx, b.nodeBin, fmt.Sprintf("node-%s-n%d", name, n), "node", append([]string{
			"--node-name", name, "--allowed-base-paths", base, "--profiling",
			"--csi-endpoint", "unix://" + filepath.Join(own, "csi.sock"),
			"--plugin-registration-dir", filepath.Join(own, "registry")}, b.common...)...)
		procs[i] = p
		return err
	}
	if err := benchkit.Parallel(n, benchkit.Parallelism, start); err != nil {
		return r, fmt.Errorf("start node processes: %w", err)
	}
	// Started in parallel, two processes can be handed the same free port: the second one
	// exits (address already in use) after the first one's /healthz answered for it. Such a
	// process is started again, one at a time, on a new port.
	for attempt := 0; ; attempt++ {
		var gone []int
		for i, p := range procs {
			if exited, _ := p.Exited(); exited {
				gone = append(gone, i)
			}
		}
		if len(gone) == 0 {
			break
		}
		if attempt == 3 {
			return r, fmt.Errorf("node processes %v exited after starting:\n%s", gone, procs[gone[0]].Tail(2000))
		}
		for _, i := range gone {
			fmt.Printf("   (node %s exited after starting: started again)\n", simNodeName(i))
			if err := start(i); err != nil {
				return r, err
			}
		}
	}
	fmt.Printf("   (N=%d: %d node processes healthy)\n", n, n)
	ns := fmt.Sprintf("sim-%d", n)
	claim := benchkit.Creator(b.ctx, b.client, claims(ns, nodesClass, ""))
	bound, _, err := benchkit.Bind(b.ctx, b.client, ns, r.Claims, func(i int) error {
		if err := claim(i); err != nil {
			return err
		}
		_, err := b.client.CoreV1().Pods(ns).Create(b.ctx, simPod(ns, fmt.Sprintf("c-%04d", i)), metav1.CreateOptions{})
		return err
	}, *flagTimeout, nil)
	if err != nil {
		return r, fmt.Errorf("claims and pods: %w", err)
	}
	r.BoundSeconds = bound.Seconds()
	r.ClaimsPerS = float64(r.Claims) / r.BoundSeconds
	if r.SpreadMin, r.SpreadMax, err = b.checkSpread(ns, n); err != nil {
		return r, err
	}
	counts := make([]map[string]float64, n)
	// Idle first, so that every node instance has seen every object; in parallel, since each
	// wait takes seconds.
	err = benchkit.Parallel(n, benchkit.Parallelism, func(i int) error {
		waitIdle(procs[i].Pid(), 30*time.Second)
		var err error
		counts[i], err = b.nodeCounts(procs[i])
		return err
	})
	if err != nil {
		return r, err
	}
	r.summarise(counts)
	r.APICPU = (b.apiServerCPU() - apiCPU0).Seconds()
	if r.Watches, r.APIRSSMiB, err = b.apiServerLoad(); err != nil {
		return r, err
	}
	return r, b.cleanSim(ns, base)
}

// simPod is a pod that only exists to be placed: the scheduler picks its node among the
// simulated ones, which sets the claim's selected node; it never runs (no kubelet). Its small
// requests make the scheduler spread the pods over the nodes rather than pick at random.
func simPod(ns, claim string) *v1.Pod {
	req := v1.ResourceList{v1.ResourceCPU: resource.MustParse("10m"), v1.ResourceMemory: resource.MustParse("16Mi")}
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:                  map[string]string{simLabel: "true"},
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []v1.Container{{Name: "c", Image: "bench.invalid/never-pulled",
				Resources: v1.ResourceRequirements{Requests: req}}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			}}},
		},
	}
}

// checkSpread checks that every claim's volume was made by its selected node's instance (the
// PV is pinned to that node and its directory exists), and returns the fewest and most claims
// on one node.
func (b *bench) checkSpread(ns string, n int) (lo, hi int, err error) {
	claims, err := b.client.CoreV1().PersistentVolumeClaims(ns).List(b.ctx, metav1.ListOptions{})
	if err != nil {
		return 0, 0, err
	}
	per := map[string]int{}
	for _, c := range claims.Items {
		node := c.Annotations["volume.kubernetes.io/selected-node"]
		pv, err := b.client.CoreV1().PersistentVolumes().Get(b.ctx, c.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return 0, 0, err
		}
		if pinned := pinnedNode(pv); pinned != node {
			return 0, 0, fmt.Errorf("claim %s selected node %q, its PV %s is pinned to %q", c.Name, node, pv.Name, pinned)
		}
		attrs := pv.Spec.CSI.VolumeAttributes
		if _, err := os.Stat(filepath.Join(attrs["basePath"], attrs["path"])); err != nil {
			return 0, 0, fmt.Errorf("claim %s on node %s: %w", c.Name, node, err)
		}
		per[node]++
	}
	lo = len(claims.Items)
	for i := 0; i < n; i++ {
		lo, hi = min(lo, per[simNodeName(i)]), max(hi, per[simNodeName(i)])
	}
	return lo, hi, nil
}

// pinnedNode is the hostname a local PV's node affinity requires, "" if none.
func pinnedNode(pv *v1.PersistentVolume) string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return ""
	}
	for _, t := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range t.MatchExpressions {
			if e.Key == "kubernetes.io/hostname" && len(e.Values) == 1 {
				return e.Values[0]
			}
		}
	}
	return ""
}

// cachedSeries picks the series of a dirpv process's metrics that count cached objects.
var cachedSeries = regexp.MustCompile(`^dirpv_\w*(cache|informer)\w*`)

// nodeCounts reads one node instance's figures: "peak" and "rss" (its peak and current RSS,
// MiB), "heap" (its Go heap in use right after the GC of a heap profile, MiB), "cpu" (its CPU
// seconds), and the objects it reports caching (series of its /metrics that look like
// informer cache sizes, if it has any), by series.
func (b *bench) nodeCounts(p *framework.Process) (map[string]float64, error) {
	st, err := procStatus(p.Pid())
	if err != nil {
		return nil, err
	}
	_, inuse, err := heapProfile("http://"+p.HTTPAddr, filepath.Join(b.s.Work.LogDir, p.Name+".heap.pprof"))
	if err != nil {
		return nil, err
	}
	m, err := framework.Scrape(b.ctx, p)
	c := map[string]float64{"peak": st["VmHWM"], "rss": st["VmRSS"], "heap": inuse / (1 << 20), "cpu": cpuTime(p.Pid()).Seconds()}
	for series, v := range m {
		if cachedSeries.MatchString(series) && !strings.Contains(series, "_bucket") {
			c[series] = v
		}
	}
	return c, err
}

// summarise fills r's per-node medians, maxima and totals.
func (r *nodesResult) summarise(counts []map[string]float64) {
	r.Med, r.Max, r.Total = map[string]float64{}, map[string]float64{}, map[string]float64{}
	for k := range counts[0] {
		vs := make([]float64, len(counts))
		for i, c := range counts {
			vs[i] = c[k]
			r.Total[k] += c[k]
		}
		r.Med[k], r.Max[k] = benchkit.Median(vs), slices.Max(vs)
	}
}

// cached is the series of r's figures that count cached objects, sorted.
func (r nodesResult) cached() []string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(r.Med)) {
		if cachedSeries.MatchString(k) {
			out = append(out, k)
		}
	}
	return out
}

// apiServerCPU is the CPU time the API server used so far.
func (b *bench) apiServerCPU() time.Duration {
	for _, p := range b.s.Cluster.Procs {
		if p.Name == "kube-apiserver" {
			return cpuTime(p.PID)
		}
	}
	return 0
}

// apiServerLoad returns the WATCH requests the API server has open and its RSS in MiB.
func (b *bench) apiServerLoad() (watches, rssMiB float64, err error) {
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	raw, err := b.client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("API server metrics: %w", err)
	}
	watches = benchkit.Sum(benchkit.ParseMetrics(string(raw)), "apiserver_longrunning_requests", `verb="WATCH"`)
	for _, p := range b.s.Cluster.Procs {
		if p.Name == "kube-apiserver" {
			st, err := procStatus(p.PID)
			return watches, st["VmRSS"], err
		}
	}
	return 0, 0, errors.New("no kube-apiserver process")
}

// cleanSim deletes the phase's pods (at once: no kubelet would confirm their end) and
// claims, and waits until every PV and every volume directory is gone.
func (b *bench) cleanSim(ns, base string) error {
	if err := b.client.CoreV1().Pods(ns).DeleteCollection(b.ctx, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("delete pods of %s: %w", ns, err)
	}
	_, err := b.deleteAll(ns, nodesClass, false, func() (bool, string) {
		left, err := os.ReadDir(base)
		return err == nil && len(left) == 0, fmt.Sprintf("%d volume directories left in %s", len(left), base)
	})
	return err
}

// deleteSimNodes deletes the first *made simulated nodes (their leases and CSINodes go with
// them), so later phases run on a cluster of the usual size.
func (b *bench) deleteSimNodes(made *int) {
	for i := 0; i < *made; i++ {
		if err := b.client.CoreV1().Nodes().Delete(b.ctx, simNodeName(i), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			fmt.Printf("delete node %s: %v\n", simNodeName(i), err)
		}
	}
}

func (b *bench) addNodesRows(r nodesResult) {
	k := fmt.Sprintf("nodes.%d.", r.N)
	b.ms[k+"peak"], b.ms[k+"heap"], b.ms[k+"watches"] = r.Med["peak"], r.Med["heap"], r.Watches-r.WatchesBefore
	pre := fmt.Sprintf("%d nodes: ", r.N)
	median := func(key, name, unit string) {
		b.add(Row{Name: pre + name + ", median", Value: r.Med[key], Unit: unit, Note: fmt.Sprintf("max %.1f", r.Max[key])})
	}
	median("peak", "node peak RSS", "MiB")
	median("rss", "node RSS now", "MiB")
	median("heap", "node Go heap in use", "MiB")
	for _, series := range r.cached() {
		b.add(Row{Name: pre + series + ", median", Value: r.Med[series], Unit: "",
			Note: fmt.Sprintf("max %.0f; %.0f over all nodes, for %d claims", r.Max[series], r.Total[series], r.Claims)})
	}
	b.add(Row{Name: pre + "API server WATCH requests per node", Value: (r.Watches - r.WatchesBefore) / float64(r.N), Unit: "",
		Note: fmt.Sprintf("%.0f open, %.0f before the node processes", r.Watches, r.WatchesBefore)})
	median("cpu", "node CPU from start to idle", "s")
	b.add(Row{Name: pre + "API server RSS", Value: r.APIRSSMiB, Unit: "MiB", Note: fmt.Sprintf("%.0f before the node processes", r.APIRSSBefore)})
	b.add(Row{Name: pre + "API server CPU, start to idle", Value: r.APICPU, Unit: "s"})
	b.add(Row{Name: fmt.Sprintf("%s%d claims create->all Bound", pre, r.Claims), Value: r.BoundSeconds, Unit: "s",
		Note: fmt.Sprintf("%.1f claims/s; %d-%d claims per node", r.ClaimsPerS, r.SpreadMin, r.SpreadMax)})
}

// cachedTotal is the objects all node instances of r report caching.
func (r nodesResult) cachedTotal() float64 {
	var s float64
	for _, k := range r.cached() {
		s += r.Total[k]
	}
	return s
}

// printNodesTable prints the scaling table: one line per N.
func printNodesTable(rs []nodesResult) {
	fmt.Printf("\n   simulated nodes (%d claims per node; per node instance: median / max over the nodes)\n", *flagNodeClaims)
	fmt.Printf("   | %5s | %6s | %-13s | %-13s | %-13s | %-11s | %-18s | %-14s | %7s | %9s |\n",
		"N", "claims", "peak RSS MiB", "RSS now MiB", "Go heap MiB", "CPU s", "API WATCHes (/node)", "API RSS MiB", "API CPU", "claims/s")
	for _, r := range rs {
		fmt.Printf("   | %5d | %6d | %5.1f / %5.1f | %5.1f / %5.1f | %5.1f / %5.1f | %4.1f / %4.1f | %7.0f (%5.1f)   | %5.0f (+%4.0f) | %7.1f | %9.1f |\n",
			r.N, r.Claims, r.Med["peak"], r.Max["peak"], r.Med["rss"], r.Max["rss"], r.Med["heap"], r.Max["heap"], r.Med["cpu"], r.Max["cpu"],
			r.Watches, (r.Watches-r.WatchesBefore)/float64(r.N), r.APIRSSMiB, r.APIRSSMiB-r.APIRSSBefore, r.APICPU, r.ClaimsPerS)
		for _, series := range r.cached() {
			fmt.Printf("   |       |        | %s median %.0f, max %.0f, %.0f over all nodes\n", series, r.Med[series], r.Max[series], r.Total[series])
		}
	}
}

// nodesGrowth records how the per-node figures grow from the smallest N to the largest: the
// "flat in N" target.
func (b *bench) nodesGrowth(rs []nodesResult) {
	if len(rs) < 2 {
		return
	}
	lo, hi := rs[0], rs[len(rs)-1]
	b.ms["nodes.lo"], b.ms["nodes.hi"] = float64(lo.N), float64(hi.N)
	b.ms["nodes.growth.peak"] = hi.Med["peak"] / lo.Med["peak"]
	b.ms["nodes.growth.heap"] = hi.Med["heap"] / lo.Med["heap"]
	// Objects cached per claim, over all node instances: 2 (its claim and PV, on one node)
	// when each node caches only its own, N times that when every node caches everything.
	if lo.cachedTotal() > 0 {
		b.ms["nodes.growth.cache"] = (hi.cachedTotal() / float64(hi.Claims)) / (lo.cachedTotal() / float64(lo.Claims))
	}
	b.ms["nodes.growth.watches"] = (hi.Watches - hi.WatchesBefore) / float64(hi.N) / ((lo.Watches - lo.WatchesBefore) / float64(lo.N))
	fmt.Printf("   growth from N=%d to N=%d (%.0fx the nodes and volumes): node peak RSS %.2fx, node Go heap %.2fx, API server WATCHes per node %.2fx, API server RSS +%.0f MiB\n",
		lo.N, hi.N, float64(hi.N)/float64(lo.N), b.ms["nodes.growth.peak"], b.ms["nodes.growth.heap"], b.ms["nodes.growth.watches"], hi.APIRSSMiB-lo.APIRSSMiB)
}
