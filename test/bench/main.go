// Command bench measures dirpv against the ceiling the cluster itself sets, on a real control
// plane from test/cluster (no kubelet) with dirpv's controller and node as real processes; its
// NFS rows come from the VM node tier (nfsKernel), through a kernel NFS client and server:
//
//	go run ./test/bench [-n 500] [-json out.json] [-kcm fast|stock]
//
// It needs root (bind mounts). Every dirpv figure is printed with its ratio to its
// ceiling: binding without any provisioner (PVs made up front), an ideal external provisioner
// (the bench itself creates each PV the instant kube-controller-manager hands it the claim), a
// bare bind mount, provisioning without size limits for provisioning with them, and for
// memory the goal itself. The machine is shared, so the ratios matter
// more than the absolute figures: ceiling and dirpv run back to back on the same cluster.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
)

const (
	nodeName      = "bench-node"
	noProvisioner = "kubernetes.io/no-provisioner"
	idealName     = "bench.invalid/ideal"
)

var (
	flagN        = flag.Int("n", 500, "claims per bulk run (create->Bound, deletion)")
	flagLatN     = flag.Int("latency-n", 30, "sequential claims for single-claim latency")
	flagLatGap   = flag.Duration("latency-gap", 250*time.Millisecond, "pause before each single-claim latency claim, so that it meets the idle client rate limiters (dirpv's, kube-controller-manager's) a lone claim meets; 0: back to back, which measures a stream of claims instead")
	flagPubN     = flag.Int("publish-n", 200, "NodePublish+NodeUnpublish iterations (and as many bare bind mounts)")
	flagRSSN     = flag.Int("rss-n", 1000, "claims bound before reading peak RSS")
	flagJSON     = flag.String("json", "", "write the results as JSON to this file")
	flagKCM      = flag.String("kcm", "fast", `kube-controller-manager client limits: "fast" (--kube-api-qps=200 --kube-api-burst=400) or "stock" (its defaults, 20/30)`)
	flagNFS      = flag.Bool("nfs", true, "run the NFS backend phase (in the VM node tier, through the guest's kernel NFS client and server; root, qemu)")
	flagKeepLogs = flag.Bool("keep-logs", false, "keep the work dir with all logs")
	flagDirpv    = flag.String("dirpv-args", "", "extra flags for both dirpv processes, space-separated (e.g. \"--kube-api-qps=50\")")
	flagEnv      = flag.String("dirpv-env", "", "extra environment for both dirpv processes, space-separated (e.g. \"GOGC=50\")")
	flagTimeout  = flag.Duration("phase-timeout", 10*time.Minute, "deadline of each phase")
	flagPolicy   = flag.Bool("node-label-policy", true, "install deploy/'s MutatingAdmissionPolicy that labels placed local claims with their node, as deploy/ does; false: dirpv controller labels them (clusters before Kubernetes 1.36)")
	flagOnly     = flag.String("only", "", "comma-separated groups to run (ceiling,ideal,local,limits,nfs,publish,nodes,rss,copy,reflink,copyvm,stock); empty: all. ceiling is always run, but for -only nodes")
)

// Row is one measured figure with its reference.
type Row = benchkit.Row

// Goal is one of the bench's targets.
type Goal struct {
	What   string  `json:"what"`
	Target string  `json:"target"`
	Actual float64 `json:"actual"`
	Met    bool    `json:"met"`
}

// Report is the JSON output.
type Report struct {
	Started         time.Time                     `json:"started"`
	N               int                           `json:"n"`
	LatencyN        int                           `json:"latencyN"`
	LatencyGap      time.Duration                 `json:"latencyGapNanoseconds"`
	PublishN        int                           `json:"publishN"`
	RSSN            int                           `json:"rssN"`
	KCM             string                        `json:"kcm"`
	KCMArgs         []string                      `json:"kcmArgs"`
	DirpvArgs       []string                      `json:"dirpvArgs"`
	DirpvEnv        []string                      `json:"dirpvEnv,omitempty"`
	NodeLabelPolicy bool                          `json:"nodeLabelPolicy"`
	CPUs            int                           `json:"cpus"`
	LoadAvg         string                        `json:"loadAvg"`
	Rows            []Row                         `json:"rows"`
	Goals           []Goal                        `json:"goals"`
	Targets         []Target                      `json:"targets"`
	CPU             map[string]map[string]float64 `json:"cpuSecondsByPhase"`
	Phases          []string                      `json:"phases"`
}

type bench struct {
	ctx    context.Context
	s      *framework.Suite
	client kubernetes.Interface
	// nodeBin and ctrlBin are copies of the binary under test (s.Dirpv) for the node and the
	// controller, as on a real cluster where the two rarely share a node: no page of the
	// binary is mapped by both processes, so each one's file-backed RSS is its own, and the
	// kernel can page out either's (binaryWorkingSet).
	nodeBin, ctrlBin string
	common           []string
	node             *framework.Process
	ctrl             *framework.Process
	report           Report
	ms               map[string]float64 // named figures for goals
	only             map[string]bool
}

func main() {
	flag.Parse()
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(1)
	}
}

func run() (err error) {
	if os.Geteuid() != 0 {
		return errors.New("needs root (bind mounts)")
	}
	b := &bench{ctx: context.Background(), ms: map[string]float64{}, only: map[string]bool{}}
	b.report = Report{Started: time.Now(), N: *flagN, LatencyN: *flagLatN, LatencyGap: *flagLatGap, PublishN: *flagPubN, RSSN: *flagRSSN,
		KCM: *flagKCM, CPUs: runtime.NumCPU(), CPU: map[string]map[string]float64{}}
	if la, err := os.ReadFile("/proc/loadavg"); err == nil {
		b.report.LoadAvg = strings.TrimSpace(string(la))
	}
	switch *flagKCM {
	case "fast":
		b.report.KCMArgs = []string{"--kube-api-qps=200", "--kube-api-burst=400"}
	case "stock":
	default:
		return fmt.Errorf("-kcm %q: want fast or stock", *flagKCM)
	}
	for _, g := range strings.Split(*flagOnly, ",") {
		if g != "" {
			b.only[g] = true
		}
	}
	if err := b.setup(); err != nil {
		return err
	}
	defer b.s.Close()
	defer func() {
		if err == nil {
			b.s.Work.Succeeded()
		}
	}()
	defer func() {
		if err != nil {
			for _, p := range []*framework.Process{b.node, b.ctrl} {
				if p != nil {
					fmt.Fprintf(os.Stderr, "--- %s log tail:\n%s\n", p.Name, p.Tail(3000))
				}
			}
		}
	}()
	steps := []struct {
		group, name string
		fn          func() error
	}{
		{"ceiling", "ceiling bulk", b.ceilingBulk},
		{"ceiling", "ceiling latency", b.ceilingLatency},
		{"ideal", "ideal external provisioner", b.idealExternal},
		{"ceiling", "ceiling deletion", b.ceilingDeletion},
		{"ceiling", "start dirpv", b.startDirpv},
		{"local", "dirpv local bulk", b.localBulk},
		{"local", "dirpv local latency", b.localLatency},
		{"local", "dirpv local deletion", b.localDeletion},
		{"limits", "dirpv local with size limits", b.localLimits},
		{"nfs", "dirpv nfs bulk+deletion+publish (kernel NFS, VM node)", b.nfsKernel},
		{"publish", "publish", b.publish},
		{"nodes", "simulated nodes", b.nodes},
		{"rss", "rss", b.rss},
		{"copy", "dirpv clone of 1M names + 200k hard links (memory)", b.copyMemory},
		{"copy", "dirpv clone against cp -a (ext4)", b.copyPlain},
		{"reflink", "dirpv reflink clones, small and large source (btrfs)", b.copyReflink},
		{"copyvm", "dirpv XFS reflink and NFSv4.2 clones (VM)", b.copyGuest},
		{"stock", "stock kube-controller-manager", b.stock},
	}
	only := b.only
	// The simulated nodes compare with each other, not with the ceiling.
	ceiling := !(len(only) == 1 && only["nodes"])
	for _, s := range steps {
		wanted := len(only) == 0 || (s.group == "ceiling" && ceiling) || only[s.group] || (s.group == "ideal" && only["local"])
		if ((s.group == "nfs" || s.group == "copyvm") && !*flagNFS) || !wanted {
			continue
		}
		if s.group == "publish" && !only["local"] && len(only) > 0 {
			// publish needs a local claim from the latency phase
			if err := b.localClass("bench-local-lat", filepath.Join(b.s.Work.Dir, "base-lat")); err != nil {
				return err
			}
			if _, err := b.latency("local-lat", "bench-local-lat", nodeName, 1, nil); err != nil {
				return err
			}
		}
		fmt.Printf("== %s\n", s.name)
		before := b.cpuSnapshot()
		if err := s.fn(); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		after := b.cpuSnapshot()
		cpu := map[string]float64{}
		for k, v := range after {
			cpu[k] = (v - before[k]).Seconds()
		}
		b.report.CPU[s.name] = cpu
		b.report.Phases = append(b.report.Phases, s.name)
	}
	b.goals()
	b.report.Targets = buildTargets(b.ms, *flagRSSN, *flagN, *flagKCM)
	b.print()
	printTargets(b.report.Targets)
	if *flagJSON != "" {
		out, _ := json.MarshalIndent(b.report, "", "  ")
		if err := os.WriteFile(*flagJSON, append(out, '\n'), 0o644); err != nil {
			return err
		}
		fmt.Printf("wrote %s\n", *flagJSON)
	}
	return nil
}

func (b *bench) setup() error {
	t0 := time.Now()
	var err error
	b.s, err = framework.StartSuite(b.ctx, framework.SuiteOptions{
		Name:     "bench",
		Cluster:  cluster.Options{ControllerManagerArgs: b.report.KCMArgs, Logf: func(string, ...any) {}},
		Dirpv:    true,
		KeepLogs: *flagKeepLogs,
	})
	if err != nil {
		return err
	}
	if err := b.prepare(); err != nil {
		b.s.Close()
		return err
	}
	fmt.Printf("setup %s: cluster (kube-controller-manager %s %v), node %s, dirpv built, work dir %s\n",
		time.Since(t0).Round(time.Millisecond), *flagKCM, b.report.KCMArgs, nodeName, b.s.Work.Dir)
	return nil
}

// prepare makes the bench's own client, its node and the dirpv arguments.
func (b *bench) prepare() error {
	if err := os.MkdirAll(filepath.Join(b.s.Work.Dir, "targets"), 0o755); err != nil {
		return err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", b.s.Cluster.Kubeconfig)
	if err != nil {
		return err
	}
	// The bench's own client must never be what limits a run.
	cfg.QPS, cfg.Burst = 5000, 10000
	cfg.UserAgent = "dirpv-bench"
	if b.client, err = kubernetes.NewForConfig(cfg); err != nil {
		return err
	}
	if err := b.s.Cluster.CreateReadyNode(b.ctx, nodeName, nil); err != nil {
		return err
	}
	// The namespace an install runs dirpv in, where its processes publish CSIStorageCapacity
	// objects; without it each publish fails and is retried, traffic no cluster has.
	if err := benchkit.CreateNamespace(b.ctx, b.client, "dirpv"); err != nil {
		return err
	}
	// dirpv node runs without kubelet registration here; list it as kubelet would, so the
	// controller does not report (and look up) a missing node plugin for every claim.
	if err := b.s.Cluster.RegisterCSIDriver(b.ctx, nodeName, "dirpv.io"); err != nil {
		return err
	}
	if b.report.NodeLabelPolicy = *flagPolicy; *flagPolicy {
		if _, err := framework.ApplyFile(b.ctx, b.s.Cluster.Kubeconfig, framework.NodeLabelPolicy); err != nil {
			return err
		}
	}
	b.nodeBin, b.ctrlBin = filepath.Join(b.s.Work.Dir, "dirpv-node"), filepath.Join(b.s.Work.Dir, "dirpv-controller")
	for _, dst := range []string{b.nodeBin, b.ctrlBin} {
		if err := copyUncached(b.s.Dirpv, dst); err != nil {
			return err
		}
	}
	// --profiling: the rss phase reads each process's live heap after a forced GC from pprof.
	b.common = append([]string{"--v=2", "--profiling"}, strings.Fields(*flagDirpv)...)
	b.report.DirpvArgs = strings.Fields(*flagDirpv)
	b.report.DirpvEnv = strings.Fields(*flagEnv)
	if len(b.only) == 0 || b.only["limits"] {
		if err := b.mountLimitBases(); err != nil {
			return err
		}
	}
	if len(b.only) == 0 || b.only["copy"] {
		// Before dirpv starts, as the limit bases, so that it is unmounted once dirpv has let go.
		if err := b.s.MountExt4(b.plainFS(), 8<<30); err != nil {
			return err
		}
	}
	if len(b.only) == 0 || b.only["reflink"] {
		return b.mountReflinkBase()
	}
	return nil
}

// cpuSnapshot reads the CPU time used so far by the cluster's and dirpv's processes.
func (b *bench) cpuSnapshot() map[string]time.Duration {
	out := map[string]time.Duration{}
	for _, p := range b.s.Cluster.Procs {
		out[p.Name] += cpuTime(p.PID)
	}
	for _, p := range []*framework.Process{b.node, b.ctrl} {
		if p == nil {
			continue
		}
		out["dirpv "+p.Args[0]] += cpuTime(p.Pid())
	}
	out["bench"] = cpuTime(os.Getpid())
	return out
}

func (b *bench) add(r Row) {
	fmt.Printf("   %s\n", r.Line(48))
	b.report.Rows = append(b.report.Rows, r)
}

// bulk creates n claims and waits until all are Bound; it returns the time from the first
// create to the last Bound.
func (b *bench) bulk(ns, class, node string, n int) (time.Duration, error) {
	d, w, err := benchkit.Bind(b.ctx, b.client, ns, n, benchkit.Creator(b.ctx, b.client, claims(ns, class, node)), *flagTimeout, func() { b.settle(class) })
	if err != nil {
		return 0, err
	}
	// Every claim is Bound by now, those handed to a provisioner too.
	if handed, bound := w.First(benchkit.Handed), w.First(benchkit.Bound); len(handed) > 0 {
		var toBound time.Duration
		for k, t := range handed {
			toBound += bound[k].Sub(t)
		}
		t0 := w.Last(benchkit.Bound).Add(-d)
		fmt.Printf("   (%s: all %d claims handed to the provisioner by kube-controller-manager after %.2fs; all Bound after %.2fs; mean hand-over->Bound %.0f ms)\n",
			class, n, w.Last(benchkit.Handed).Sub(t0).Seconds(), d.Seconds(), ms(toBound/time.Duration(len(handed))))
	}
	return d, nil
}

// latency creates claims one at a time, each after the previous one is Bound, and returns
// each one's create->Bound time. before, if set, runs before each claim is created (untimed).
func (b *bench) latency(ns, class, node string, n int, before func(name string) error) ([]time.Duration, error) {
	if err := benchkit.CreateNamespace(b.ctx, b.client, ns); err != nil {
		return nil, err
	}
	w, err := benchkit.WatchClaims(b.ctx, b.client, ns)
	if err != nil {
		return nil, err
	}
	defer w.Stop()
	b.settle(class)
	var out []time.Duration
	steps := []string{benchkit.Handed, benchkit.Labelled, benchkit.Volume, benchkit.Bound}
	spans := map[string][]time.Duration{}
	defer func() {
		// Medians of each step's time from the claim's creation, where the step was seen.
		var parts []string
		for i, what := range []string{"handed to provisioner", "labelled with node", "PV created", "Bound"} {
			if len(spans[steps[i]]) > 0 {
				parts = append(parts, fmt.Sprintf("%s %.1f ms", what, ms(benchkit.Percentile(spans[steps[i]], 50))))
			}
		}
		fmt.Printf("   (%s: p50 from create: %s)\n", class, strings.Join(parts, ", "))
	}()
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("l-%04d", i)
		select {
		case <-time.After(*flagLatGap):
		case <-b.ctx.Done():
			return nil, b.ctx.Err()
		}
		if before != nil {
			if err := before(name); err != nil {
				return nil, err
			}
		}
		t0 := time.Now()
		if _, err := b.client.CoreV1().PersistentVolumeClaims(ns).Create(b.ctx, newClaim(ns, name, class, node), metav1.CreateOptions{}); err != nil {
			return nil, err
		}
		at, err := w.WaitOne(b.ctx, name, time.Minute)
		if err != nil {
			return nil, err
		}
		out = append(out, at.Sub(t0))
		for _, step := range steps {
			if t, ok := w.First(step)[name]; ok {
				spans[step] = append(spans[step], t.Sub(t0))
			}
		}
	}
	return out, nil
}

// deleteAll is benchkit.DeleteAll on the bench's cluster.
func (b *bench) deleteAll(ns, class string, idealDeleter bool, done func() (bool, string)) (time.Duration, error) {
	return benchkit.DeleteAll(b.ctx, b.client, ns, class, idealDeleter, *flagTimeout, done)
}

// ---- ceilings ----

func (b *bench) ceilingBulk() error {
	n := *flagN
	if err := b.createClass(framework.NewClass("bench-static", nil, framework.Provisioner(noProvisioner), framework.Immediate)); err != nil {
		return err
	}
	const ns = "ceil-bulk"
	d, err := benchkit.Ceiling(b.ctx, b.client, ns, n, claims(ns, "bench-static", ""), *flagTimeout, func() { b.settle("bench-static") })
	if err != nil {
		return err
	}
	b.ms["ceil.bulk"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("ceiling: %d pre-made PVs, create->all Bound", n), Value: d.Seconds(), Unit: "s",
		Note: fmt.Sprintf("%.1f bindings/s", float64(n)/d.Seconds())})
	return nil
}

func (b *bench) ceilingLatency() error {
	if err := b.createClass(framework.NewClass("bench-static-lat", nil, framework.Provisioner(noProvisioner), framework.Immediate)); err != nil {
		return err
	}
	const ns = "ceil-lat"
	ds, err := b.latency(ns, "bench-static-lat", "", *flagLatN, func(name string) error {
		pv := benchkit.BoundPV("ceil-lat-"+name, newClaim(ns, name, "bench-static-lat", ""), v1.PersistentVolumeReclaimRetain)
		if _, err := b.client.CoreV1().PersistentVolumes().Create(b.ctx, pv, metav1.CreateOptions{}); err != nil {
			return err
		}
		return framework.Poll(b.ctx, 30*time.Second, func(ctx context.Context) (bool, error) {
			got, err := b.client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			return got.Status.Phase == v1.VolumeAvailable, fmt.Errorf("PV %s is %q", pv.Name, got.Status.Phase)
		})
	})
	if err != nil {
		return err
	}
	b.latencyRows("ceil", "ceiling: single claim create->Bound", ds, "")
	return nil
}

// idealExternal measures external provisioning with a provisioner that takes no time at all:
// what any external provisioner, dirpv included, can at best reach. The gap to the ceiling is
// kube-controller-manager's extra step (it annotates the claim for the provisioner first).
func (b *bench) idealExternal() (err error) {
	if err := b.createClass(framework.NewClass("bench-ideal", nil, framework.Provisioner(idealName))); err != nil {
		return err
	}
	stop, err := benchkit.StartIdeal(b.ctx, b.client, idealName, "")
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, stop()) }()
	// WaitForFirstConsumer with the selected node set, exactly like dirpv's local claims.
	d, err := b.bulk("ideal-bulk", "bench-ideal", nodeName, *flagN)
	if err != nil {
		return err
	}
	b.ms["ideal.bulk"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("ideal external provisioner, WFFC: %d claims", *flagN), Value: d.Seconds(), Unit: "s",
		Ref: "ceiling", RefValue: b.ms["ceil.bulk"]})
	ds, err := b.latency("ideal-lat", "bench-ideal", nodeName, *flagLatN, nil)
	if err != nil {
		return err
	}
	b.latencyRows("ideal", "ideal external provisioner, WFFC: single claim", ds, "")
	// Clean up untimed, so later phases run on a cluster as small as the ceiling's was.
	for _, ns := range []string{"ideal-bulk", "ideal-lat"} {
		if _, err := b.deleteAll(ns, "bench-ideal", true, nil); err != nil {
			return fmt.Errorf("clean up %s: %w", ns, err)
		}
	}
	return nil
}

func (b *bench) ceilingDeletion() error {
	d, err := b.deleteAll("ceil-bulk", "bench-static", true, nil)
	if err != nil {
		return err
	}
	b.ms["ceil.delete"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("ceiling: delete %d claims, ideal deleter", *flagN), Value: d.Seconds(), Unit: "s"})
	return nil
}

// ---- dirpv ----

func (b *bench) startDirpv() error {
	var err error
	b.node, b.ctrl, err = b.startProcesses("")
	return err
}

func (b *bench) startProcesses(suffix string) (node, ctrl *framework.Process, err error) {
	// The framework starts processes with this process's environment; only the dirpv
	// processes get the extra variables (the cluster is running already).
	for _, kv := range strings.Fields(*flagEnv) {
		k, v, _ := strings.Cut(kv, "=")
		os.Setenv(k, v)
		defer os.Unsetenv(k)
	}
	node, err = b.s.StartDirpvBin(b.ctx, b.nodeBin, "node"+suffix, "node", append([]string{
		"--node-name", nodeName, "--allowed-base-paths", b.s.Work.Dir,
		"--csi-endpoint", "unix://" + b.csiSocket(),
		"--plugin-registration-dir", "-"}, b.common...)...)
	if err != nil {
		return nil, nil, err
	}
	args := []string{"--work-dir", filepath.Join(b.s.Work.Dir, "controller"), "--leader-election=false"}
	ctrl, err = b.s.StartDirpvBin(b.ctx, b.ctrlBin, "controller"+suffix, "controller", append(args, b.common...)...)
	if err != nil {
		return node, nil, err
	}
	return node, ctrl, nil
}

func (b *bench) csiSocket() string { return filepath.Join(b.s.Work.Dir, "csi.sock") }

func (b *bench) localClass(name, base string) error {
	if err := b.createClass(framework.NewClass(name, map[string]string{"backend": "local", "basePath": base})); err != nil {
		return err
	}
	if !*flagPolicy {
		return nil
	}
	return framework.WaitNodeLabelPolicy(b.ctx, b.client, "dirpv", name, 30*time.Second)
}

func (b *bench) localBulk() error {
	base := filepath.Join(b.s.Work.Dir, "base-bulk")
	if err := b.localClass("bench-local", base); err != nil {
		return err
	}
	before := b.provisionStats()
	d, err := b.bulk("local-bulk", "bench-local", nodeName, *flagN)
	if err != nil {
		return err
	}
	after := b.provisionStats()
	if ents, _ := os.ReadDir(base); len(ents) != *flagN {
		return fmt.Errorf("%d directories in %s for %d claims", len(ents), base, *flagN)
	}
	b.ms["local.bulk"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("dirpv local: %d claims create->all Bound", *flagN), Value: d.Seconds(), Unit: "s",
		Ref: "ceiling", RefValue: b.ms["ceil.bulk"],
		Note: fmt.Sprintf("%.2fx ideal external; mean lib provisioning op %.1f ms", d.Seconds()/b.ms["ideal.bulk"], meanMS(before, after))})
	fmt.Printf("   (%.2fx the ideal external provisioner; mean lib provisioning op (event+Provision+PV create) %.1f ms; %d client-side throttling waits logged)\n",
		d.Seconds()/b.ms["ideal.bulk"], meanMS(before, after), throttled(b.node))
	return nil
}

func (b *bench) localLatency() error {
	if err := b.localClass("bench-local-lat", filepath.Join(b.s.Work.Dir, "base-lat")); err != nil {
		return err
	}
	libBefore, ownBefore := b.provisionStats(), b.histogramStats(dirpvProvision)
	ds, err := b.latency("local-lat", "bench-local-lat", nodeName, *flagLatN, nil)
	if err != nil {
		return err
	}
	fmt.Printf("   (mean lib provisioning op (event+Provision+PV create) %.1f ms, of it dirpv's Provision %.1f ms)\n",
		meanMS(libBefore, b.provisionStats()), meanMS(ownBefore, b.histogramStats(dirpvProvision)))
	b.latencyRows("local", "dirpv local: single claim create->Bound", ds, "ideal")
	return nil
}

// latencyRows records the p50 and p95 of ds as figures key.p50 and key.p95 and adds their rows,
// against the ceiling's but for the ceiling itself, and noting the ratio to vs's if set.
func (b *bench) latencyRows(key, name string, ds []time.Duration, vs string) {
	for _, q := range []float64{50, 95} {
		p := fmt.Sprintf("p%.0f", q)
		v := ms(benchkit.Percentile(ds, q))
		b.ms[key+"."+p] = v
		r := Row{Name: name + " " + p, Value: v, Unit: "ms"}
		if key != "ceil" {
			r.Ref, r.RefValue = "ceiling", b.ms["ceil."+p]
		}
		if vs != "" {
			r.Note = fmt.Sprintf("%.2fx ideal external", v/b.ms[vs+"."+p])
		}
		b.add(r)
	}
}

func (b *bench) localDeletion() error {
	base := filepath.Join(b.s.Work.Dir, "base-bulk")
	d, err := b.deleteAll("local-bulk", "bench-local", false, func() (bool, string) {
		ents, err := os.ReadDir(base)
		return err == nil && len(ents) == 0, fmt.Sprintf("%d directories left in %s", len(ents), base)
	})
	if err != nil {
		return err
	}
	b.ms["local.delete"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("dirpv local: delete %d claims, PVs+dirs gone", *flagN), Value: d.Seconds(), Unit: "s",
		Ref: "ceiling", RefValue: b.ms["ceil.delete"]})
	return nil
}

// localLimits measures what enforcing sizes costs provisioning: the same claims, bulk and one
// at a time, on two btrfs file systems of the same size, one with quota (each volume a
// subvolume with a qgroup limit) and one without (each volume a directory). The one without
// is what a base that cannot enforce gets with capacityEnforcement bestEffort, the default,
// including its SizeNotEnforced event per claim. btrfs is the only file system whose limits
// work on this host's kernel (XFS and ext4 project quotas need the VM tier).
func (b *bench) localLimits() error {
	sides := b.limitSides()
	for _, sd := range sides {
		if err := b.localClass(sd.class, sd.base); err != nil {
			return err
		}
	}
	for _, sd := range sides {
		before, beforeOwn := b.provisionStats(), b.histogramStats(dirpvProvision)
		d, err := b.bulk("limits-bulk-"+sd.key, sd.class, nodeName, *flagN)
		if err != nil {
			return err
		}
		after, afterOwn := b.provisionStats(), b.histogramStats(dirpvProvision)
		b.ms["limits.own."+sd.key] = meanMS(beforeOwn, afterOwn)
		if ents, _ := os.ReadDir(sd.base); len(ents) != *flagN {
			return fmt.Errorf("%d volumes in %s for %d claims", len(ents), sd.base, *flagN)
		}
		b.ms["limits.bulk."+sd.key] = d.Seconds()
		b.ms["limits.op."+sd.key] = meanMS(before, after)
		ds, err := b.latency("limits-lat-"+sd.key, sd.class, nodeName, *flagLatN, nil)
		if err != nil {
			return err
		}
		b.ms["limits.p50."+sd.key] = ms(benchkit.Percentile(ds, 50))
		if sd.key == "limit" {
			if err := b.checkLimited(sd.base); err != nil {
				return err
			}
		}
		left := func(n int) func() (bool, string) {
			return func() (bool, string) {
				ents, err := os.ReadDir(sd.base)
				return err == nil && len(ents) == n, fmt.Sprintf("%d volumes left in %s, want %d", len(ents), sd.base, n)
			}
		}
		d, err = b.deleteAll("limits-bulk-"+sd.key, sd.class, false, left(*flagLatN))
		if err != nil {
			return err
		}
		b.ms["limits.delete."+sd.key] = d.Seconds()
		if _, err := b.deleteAll("limits-lat-"+sd.key, sd.class, false, left(0)); err != nil {
			return err
		}
	}
	for _, r := range []struct{ key, name, unit string }{
		{"bulk", fmt.Sprintf("btrfs: %d claims create->all Bound", *flagN), "s"},
		{"p50", "btrfs: single claim create->Bound p50", "ms"},
		{"op", "btrfs: mean lib provisioning op", "ms"},
		{"own", "btrfs: mean dirpv Provision (disk work)", "ms"},
		{"delete", fmt.Sprintf("btrfs: delete %d claims, PVs+dirs gone", *flagN), "s"},
	} {
		b.add(Row{Name: r.name + ", no limits", Value: b.ms["limits."+r.key+".nolimit"], Unit: r.unit})
		b.add(Row{Name: r.name + ", limits", Value: b.ms["limits."+r.key+".limit"], Unit: r.unit,
			Ref: "no limits", RefValue: b.ms["limits."+r.key+".nolimit"]})
	}
	return nil
}

// dirpvProvision is dirpv's own Provision histogram: the directory (or subvolume and limit)
// and the PV object built, no API call.
const dirpvProvision = "dirpv_provision_duration_seconds"

type limitSide struct{ key, class, base string }

// limitSides are localLimits' two btrfs bases: without quota, then with it.
func (b *bench) limitSides() []limitSide {
	return []limitSide{
		{"nolimit", "bench-btrfs-nolimit", filepath.Join(b.s.Work.Dir, "btrfs-nolimit")},
		{"limit", "bench-btrfs-limit", filepath.Join(b.s.Work.Dir, "btrfs-limit")},
	}
}

// mountLimitBases mounts localLimits' bases before dirpv starts, so that they are unmounted
// only once dirpv has stopped and holds nothing open there.
func (b *bench) mountLimitBases() error {
	for _, sd := range b.limitSides() {
		// Larger than a claim (1Gi): dirpv refuses a local volume larger than the base's
		// free space. The image is sparse; the volumes stay empty.
		if err := b.s.MountBtrfs(sd.base, 4<<30, sd.key == "limit"); err != nil {
			return err
		}
	}
	return nil
}

// checkLimited fails unless every volume in base is a btrfs subvolume, which dirpv makes only
// to put a qgroup limit on it: a subvolume's root directory is inode 256
// (BTRFS_FIRST_FREE_OBJECTID), which no plain directory is.
func (b *bench) checkLimited(base string) error {
	ents, err := os.ReadDir(base)
	if err != nil {
		return err
	}
	for _, e := range ents {
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(base, e.Name()), &st); err != nil {
			return err
		}
		if st.Ino != 256 {
			return fmt.Errorf("volume %s in %s is not a btrfs subvolume (inode %d): no limit was set", e.Name(), base, st.Ino)
		}
	}
	return nil
}

// libProvisionOp is the lib's provisioning operation histogram: event, Provision, PV create.
const libProvisionOp = "dirpv_persistentvolumeclaim_provision_duration_seconds"

// provisionStats sums the lib's provision duration histogram over both dirpv processes.
func (b *bench) provisionStats() [2]float64 { return b.histogramStats(libProvisionOp) }

// histogramStats sums a histogram's _sum and _count over both dirpv processes and all labels.
func (b *bench) histogramStats(name string) [2]float64 {
	var out [2]float64
	for _, p := range []*framework.Process{b.node, b.ctrl} {
		m, err := benchkit.Metrics(b.ctx, "http://"+p.HTTPAddr+"/metrics")
		if err != nil {
			continue
		}
		out[0] += benchkit.Sum(m, name+"_sum")
		out[1] += benchkit.Sum(m, name+"_count")
	}
	return out
}

// throttled counts client-go's "client-side throttling" log lines of a process so far.
func throttled(p *framework.Process) int {
	log, _ := os.ReadFile(p.Log)
	return strings.Count(string(log), "client-side throttling")
}

func meanMS(before, after [2]float64) float64 {
	if after[1] == before[1] {
		return 0
	}
	return (after[0] - before[0]) / (after[1] - before[1]) * 1000
}

// The memory targets: peak RSS below the best peer's measured 38 MB (nfs-subdir),
// and Go heap growth under 8 MiB per 1000 PVs.
const (
	peerRSSMiB        = 38e6 / (1 << 20)
	heapGrowthGoalMiB = 8.0
	peerRSSRef        = "best peer (38 MB)"
	heapGoalRefFormat = "goal (%g MiB)"
)

// rss restarts both dirpv processes, so their peak covers this phase only, binds rssN local
// claims through them, and reads their peak RSS; then restarts them once more over the rssN
// existing PVs and PVCs (the informers' initial list) and reads it again. Each process's heap
// growth is its live heap (after a forced GC) with the PVs minus its own before the first.
func (b *bench) rss() error {
	b.node.Stop(10 * time.Second)
	b.ctrl.Stop(10 * time.Second)
	var err error
	if b.node, b.ctrl, err = b.startProcesses("-rss"); err != nil {
		return err
	}
	// The floor: the same binary serving CSI only (no API client, no informers, no PVs).
	floor, err := framework.StartDirpv(b.ctx, b.nodeBin, "node-floor", b.s.Work.LogDir, "node", "--node-name", nodeName,
		"--local-provisioning=false", "--csi-endpoint", "unix://"+filepath.Join(b.s.Work.Dir, "floor.sock"), "--plugin-registration-dir", "-")
	if err != nil {
		return err
	}
	b.s.Cleanups.Add(func() { floor.Stop(10 * time.Second) })
	pid := floor.Pid()
	waitIdle(pid, 10*time.Second)
	st, _ := procStatus(pid)
	b.ms["rss.floor"] = st["VmHWM"]
	note := fmt.Sprintf("%.1f anon + %.1f file-backed (%s)", st["RssAnon"], st["RssFile"], sectionsNote(pid, b.s.Dirpv))
	b.add(Row{Name: "floor: dirpv node, CSI only, no API client (VmHWM)", Value: st["VmHWM"], Unit: "MiB",
		Ref: peerRSSRef, RefValue: peerRSSMiB, Note: note})
	fmt.Printf("   (floor now: %s)\n", note)
	floor.Stop(10 * time.Second)
	// The live Go heap of each process before it has seen a claim or volume.
	heap0 := map[string]float64{}
	for _, p := range []*framework.Process{b.node, b.ctrl} {
		waitIdle(p.Pid(), 30*time.Second)
		var err error
		if heap0[p.Args[0]], _, err = b.liveHeap(p, "-start"); err != nil {
			return err
		}
	}
	if err := b.localClass("bench-rss", filepath.Join(b.s.Work.Dir, "base-rss")); err != nil {
		return err
	}
	if _, err := b.bulk("rss", "bench-rss", nodeName, *flagRSSN); err != nil {
		return err
	}
	heapGoal := heapGrowthGoalMiB * float64(*flagRSSN) / 1000
	read := func(what string) error {
		// Both processes have seen every object once they go idle after the last binding.
		for _, p := range []*framework.Process{b.node, b.ctrl} {
			pid := p.Pid()
			waitIdle(pid, 30*time.Second)
			st, err := procStatus(pid)
			if err != nil {
				return err
			}
			live, inuse, err := b.liveHeap(p, "")
			if err != nil {
				return err
			}
			m, _ := benchkit.Metrics(b.ctx, "http://"+p.HTTPAddr+"/metrics")
			b.ms["rss."+p.Args[0]+"."+what] = st["VmHWM"]
			// What GC tuning costs shows in the CPU time (the processes started with this phase).
			cpu := cpuTime(pid).Seconds()
			b.ms["cpu."+p.Args[0]+"."+what] = cpu
			note := fmt.Sprintf("now %.1f MiB RSS = %.1f anon (Go heap: %.1f live, %.1f in spans; stacks %.1f) + %.1f file-backed (%s); CPU %.2f s since start",
				st["VmRSS"], st["RssAnon"], live/(1<<20), inuse/(1<<20), m["go_memstats_stack_inuse_bytes"]/(1<<20),
				st["RssFile"], sectionsNote(pid, b.s.Dirpv), cpu)
			b.add(Row{Name: fmt.Sprintf("dirpv %s peak RSS (VmHWM), %s", p.Args[0], what), Value: st["VmHWM"], Unit: "MiB",
				Ref: peerRSSRef, RefValue: peerRSSMiB, Note: note})
			fmt.Printf("   (%s %s)\n", p.Args[0], note)
			growth := (live - heap0[p.Args[0]]) / (1 << 20)
			b.ms["heap."+p.Args[0]+"."+what] = growth
			b.add(Row{Name: fmt.Sprintf("dirpv %s Go heap growth, %s", p.Args[0], what), Value: growth, Unit: "MiB",
				Ref: fmt.Sprintf(heapGoalRefFormat, heapGoal), RefValue: heapGoal,
				Note: fmt.Sprintf("live heap after a GC: %.1f MiB, %.1f MiB before the first claim", live/(1<<20), heap0[p.Args[0]]/(1<<20))})
		}
		return nil
	}
	if err := read(fmt.Sprintf("provisioning %d", *flagRSSN)); err != nil {
		return err
	}
	b.node.Stop(10 * time.Second)
	b.ctrl.Stop(10 * time.Second)
	if b.node, b.ctrl, err = b.startProcesses("-rss2"); err != nil {
		return err
	}
	// The restarted processes' own live heap before their informers list is not measurable
	// (they list at once), so their growth is against the first processes' heap0: the same binary
	// and flags.
	if err := read(fmt.Sprintf("restarted over %d", *flagRSSN)); err != nil {
		return err
	}
	if err := b.binaryWorkingSet(); err != nil {
		return err
	}
	return nil
}

// liveHeap returns the live Go heap (HeapAlloc) and the heap's spans in use (HeapInuse) of
// dirpv process p, both right after a GC that the heap profile forces; the profile is saved to
// the log dir (name suffix) too.
func (b *bench) liveHeap(p *framework.Process, suffix string) (live, inuse float64, err error) {
	prof := filepath.Join(b.s.Work.LogDir, p.Name+suffix+".heap.pprof")
	fmt.Printf("   (%s heap profile: %s)\n", p.Args[0], prof)
	return heapProfile("http://"+p.HTTPAddr, prof)
}

// binaryWorkingSet has the kernel reclaim the binary's read-only pages of both processes,
// binds a few more claims through them, and reports how much of the binary is resident again:
// its working set, as opposed to the pages only startup touched.
func (b *bench) binaryWorkingSet() error {
	procs := []*framework.Process{b.node, b.ctrl}
	for _, p := range procs {
		if err := pageOutBinary(p.Pid()); err != nil {
			return err
		}
	}
	const n = 20
	if _, err := b.bulk("rss-ws", "bench-rss", nodeName, n); err != nil {
		return err
	}
	for _, p := range procs {
		waitIdle(p.Pid(), 30*time.Second)
		// A scrape, as Prometheus would do, is part of the steady state.
		if _, err := benchkit.Metrics(b.ctx, "http://"+p.HTTPAddr+"/metrics"); err != nil {
			return err
		}
		st, _ := procStatus(p.Pid())
		b.ms["ws."+p.Args[0]] = st["RssFile"]
		b.add(Row{Name: fmt.Sprintf("dirpv %s binary working set (file-backed RSS)", p.Args[0]), Value: st["RssFile"], Unit: "MiB",
			Note: fmt.Sprintf("after MADV_PAGEOUT of the binary and %d more claims; VmRSS now %.1f MiB (%s)", n, st["VmRSS"], sectionsNote(p.Pid(), b.s.Dirpv))})
	}
	return nil
}

// waitIdle waits until the process used less than 20 ms of CPU in a second.
func waitIdle(pid int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	last := cpuTime(pid)
	time.Sleep(2 * time.Second)
	for time.Now().Before(deadline) {
		time.Sleep(time.Second)
		now := cpuTime(pid)
		if now-last < 20*time.Millisecond {
			return
		}
		last = now
	}
}

var ms = benchkit.MS

func (b *bench) goals() {
	g := func(what, target string, actual float64, met bool) {
		if actual == 0 || actual != actual {
			return // not measured in this run
		}
		b.report.Goals = append(b.report.Goals, Goal{What: what, Target: target, Actual: actual, Met: met})
	}
	for _, r := range []struct {
		what, num, den string
		limit          float64
	}{
		{fmt.Sprintf("%d local claims create->Bound vs ceiling", *flagN), "local.bulk", "ceil.bulk", 1.2},
		// In the guest dirpv runs under emulation: its reference is the ideal provisioner there.
		{fmt.Sprintf("%d NFS claims (kernel, VM) create->Bound vs the ideal there", *flagN), "nfs.vm.nfs.bulk", "nfs.vm.ideal.bulk", 1.2},
		{fmt.Sprintf("%d local claims with size limits vs without (btrfs)", *flagN), "limits.bulk.limit", "limits.bulk.nolimit", 1.1},
		{"single local claim p50 with size limits vs without (btrfs)", "limits.p50.limit", "limits.p50.nolimit", 1.1},
		{"single local claim p50 vs ceiling", "local.p50", "ceil.p50", 1.2},
		{"publish+unpublish p50 vs bare bind mount (mount-utils)", "pub.p50", "mu.p50", 3},
		{"publish+unpublish p50 vs bare bind mount (mount(2))", "pub.p50", "sys.p50", 3},
		{"clone of 1 GiB + 110k files create->Bound vs cp -a (ext4)", "copy.plain.clone", "copy.plain.cp", plainCopyGoal},
	} {
		ratio := b.ms[r.num] / b.ms[r.den]
		g(r.what, fmt.Sprintf("<= %gx", r.limit), ratio, ratio <= r.limit)
	}
	for _, r := range []struct {
		what, small, large string
	}{
		{"btrfs", "copy.reflink.btrfs.small", "copy.reflink.btrfs.large"},
		{"XFS, VM", "copy.vm.reflink.xfs.small.clone", "copy.vm.reflink.xfs.large.clone"},
	} {
		small, large := b.ms[r.small], b.ms[r.large]
		g(fmt.Sprintf("reflink clone of %d MiB create->Bound (%s), s", *flagReflinkSmallMiB, r.what), fmt.Sprintf("< %g", reflinkSmallGoalSec), small, small < reflinkSmallGoalSec)
		g(fmt.Sprintf("reflink clone of %d MiB vs %d MiB (%s)", *flagReflinkLargeMiB, *flagReflinkSmallMiB, r.what), fmt.Sprintf("<= %gx", reflinkFlatGoal), large/small, large/small <= reflinkFlatGoal)
	}
	if clone := b.ms["copy.vm.nfs.clone"]; clone > 0 {
		cp, tar := b.ms["copy.vm.nfs.cp"], b.ms["copy.vm.nfs.tar.c"]+b.ms["copy.vm.nfs.tar.x"]
		g("clone over NFSv4.2 (VM) vs cp -a through the same mount", fmt.Sprintf("<= %gx", nfsCloneCpGoal), clone/cp, clone/cp <= nfsCloneCpGoal)
		g("tar czf + tar xzf over NFSv4.2 (VM) vs dirpv's clone", fmt.Sprintf(">= %gx", nfsCloneTarGoal), tar/clone, tar/clone >= nfsCloneTarGoal)
	}
	if idle, ok := b.ms["copy.rss.idle"]; ok {
		above := b.ms["copy.rss.peak"] - idle
		g(fmt.Sprintf("node RSS above idle cloning %d names + %d links (MiB)", copyNames, copyLinks), fmt.Sprintf("<= %g", copyRSSGoalMiB), above, above <= copyRSSGoalMiB)
	}
	for _, proc := range []string{"controller", "node"} {
		heap, _ := maxOf(b.ms, "heap."+proc+".")
		heap *= 1000 / float64(*flagRSSN)
		g(proc+" Go heap growth per 1000 PVs (MiB)", fmt.Sprintf("< %g", heapGrowthGoalMiB), heap, heap < heapGrowthGoalMiB)
	}
	for _, proc := range []string{"controller", "node"} {
		peak, _ := maxOf(b.ms, "rss."+proc+".")
		g(fmt.Sprintf("%s peak RSS with %d PVs (MiB)", proc, *flagRSSN), fmt.Sprintf("< %.1f", peerRSSMiB), peak, peak < peerRSSMiB)
	}
}

func (b *bench) print() {
	rp := b.report
	fmt.Printf("\ndirpv bench: n=%d, latency-n=%d (%v apart), publish-n=%d, rss-n=%d; kube-controller-manager %s %v; dirpv flags: defaults %v env %v; %d CPUs, load %s\n\n",
		rp.N, rp.LatencyN, rp.LatencyGap, rp.PublishN, rp.RSSN, rp.KCM, rp.KCMArgs, rp.DirpvArgs, rp.DirpvEnv, rp.CPUs, rp.LoadAvg)
	fmt.Printf("| %-52s | %10s | %-26s |\n", "measurement", "value", "ratio")
	fmt.Printf("|%s|%s|%s|\n", strings.Repeat("-", 54), strings.Repeat("-", 12), strings.Repeat("-", 28))
	for _, r := range rp.Rows {
		ratio := ""
		if r.Ratio > 0 {
			ratio = fmt.Sprintf("%.2fx %s", r.Ratio, r.Ref)
		}
		fmt.Printf("| %-52s | %6.1f %-3s | %-26s |\n", r.Name, r.Value, r.Unit, ratio)
	}
	fmt.Println()
	for _, g := range rp.Goals {
		met := "MET"
		if !g.Met {
			met = "MISSED"
		}
		fmt.Printf("goal %-55s %-7s actual %6.2f  %s\n", g.What, g.Target, g.Actual, met)
	}
	fmt.Println("\nCPU seconds by phase:")
	var names []string
	for k := range rp.CPU[rp.Phases[0]] {
		names = append(names, k)
	}
	for _, ph := range rp.Phases {
		for k := range rp.CPU[ph] {
			if !slices.Contains(names, k) {
				names = append(names, k)
			}
		}
	}
	for _, ph := range rp.Phases {
		var parts []string
		for _, k := range names {
			if v := rp.CPU[ph][k]; v >= 0.05 {
				parts = append(parts, fmt.Sprintf("%s %.1f", k, v))
			}
		}
		fmt.Printf("  %-28s %s\n", ph, strings.Join(parts, ", "))
	}
}
