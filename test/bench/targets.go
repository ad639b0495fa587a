package main

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/framework"
)

// Target is one row of the targets table: a figure of this run against its target.
type Target struct {
	Figure   string  `json:"figure"`
	Target   string  `json:"target"`
	Value    float64 `json:"value,omitempty"`
	Unit     string  `json:"unit,omitempty"`
	Ratio    float64 `json:"ratio,omitempty"`
	Measured bool    `json:"measured"`
	Met      bool    `json:"met"`
	// Why says why a figure was not measured, where the run cannot tell by itself.
	Why string `json:"why,omitempty"`
}

// Status is "met", "missed" or "not measured".
func (t Target) Status() string {
	switch {
	case !t.Measured:
		return "not measured"
	case t.Met:
		return "met"
	}
	return "missed"
}

// bestPeerMB is the least peak RSS measured of the provisioners dirpv replaces
// (nfs-subdir-external-provisioner, 38 MB), in the MB (10^6 bytes) it was measured in.
const bestPeerMB = 38.0

// flatInN is how much a per-node figure may grow from the smallest to the largest N of the
// nodes phase and still count as flat: the volumes per node stay the same, so with each node
// instance seeing only its own work the figure should not grow at all.
const flatInN = 1.1

// buildTargets builds the targets table from the run's named figures (b.ms): rss.*
// and heap.* of the rss phase at rssN PVs, ideal.* and local.* of the main run (with
// kube-controller-manager kcm, "fast" or "stock"), stock.* of the stock phase, nodes.* of the
// nodes phase. A figure the run did not measure gives a "not measured" row.
func buildTargets(ms map[string]float64, rssN, n int, kcm string) []Target {
	var out []Target
	for _, who := range []string{"node", "controller"} {
		t := Target{Figure: fmt.Sprintf("%s peak RSS at %d PVs", who, rssN), Target: fmt.Sprintf("< %.0f MB (best peer)", bestPeerMB), Unit: "MB"}
		if mib, ok := maxOf(ms, "rss."+who+"."); ok {
			t.Value, t.Measured = mib*(1<<20)/1e6, true
			t.Ratio, t.Met = t.Value/bestPeerMB, t.Value < bestPeerMB
		}
		out = append(out, t)
	}
	for _, who := range []string{"node", "controller"} {
		t := Target{Figure: fmt.Sprintf("%s Go heap growth per 1000 PVs", who), Target: "< 8 MiB", Unit: "MiB"}
		if mib, ok := maxOf(ms, "heap."+who+"."); ok && rssN > 0 {
			t.Value, t.Measured = mib*1000/float64(rssN), true
			t.Ratio, t.Met = t.Value/8, t.Value < 8
		}
		out = append(out, t)
	}
	ratio := func(figure, target, num, den, unit string, limit float64, strict bool) Target {
		t := Target{Figure: figure, Target: target, Unit: unit}
		if a, b := ms[num], ms[den]; a > 0 && b > 0 {
			t.Value, t.Ratio, t.Measured = a, a/b, true
			t.Met = t.Ratio <= limit && (!strict || t.Ratio < limit)
		}
		return t
	}
	stockLocal, stockIdeal := "stock.local.bulk", "stock.ideal.bulk"
	if kcm == "stock" {
		stockLocal, stockIdeal = "local.bulk", "ideal.bulk"
	}
	out = append(out, ratio(fmt.Sprintf("%d claims create->all Bound, stock KCM", n), "< 1.0x ideal external", stockLocal, stockIdeal, "s", 1, true))
	if kcm == "stock" {
		out = append(out, Target{Figure: fmt.Sprintf("%d claims create->all Bound, KCM unthrottled", n), Target: "<= 1.1x ideal external"},
			Target{Figure: "single claim p50, KCM unthrottled", Target: "<= 1.15x ideal external"})
	} else {
		out = append(out, ratio(fmt.Sprintf("%d claims create->all Bound, KCM unthrottled", n), "<= 1.1x ideal external", "local.bulk", "ideal.bulk", "s", 1.1, false),
			ratio("single claim p50, KCM unthrottled", "<= 1.15x ideal external", "local.p50", "ideal.p50", "ms", 1.15, false))
	}
	nodes := fmt.Sprintf("N=%.0f vs N=%.0f simulated nodes", ms["nodes.hi"], ms["nodes.lo"])
	if ms["nodes.hi"] == 0 {
		nodes = "simulated nodes"
	}
	flat := fmt.Sprintf("flat (<= %.1fx)", flatInN)
	for _, f := range []struct{ key, what string }{
		{"peak", "per-node peak RSS"},
		{"heap", "per-node Go heap (its caches)"},
		{"cache", "per-node cached objects"},
		{"watches", "API server WATCHes per node"},
	} {
		t := Target{Figure: nodes + ": " + f.what, Target: flat}
		if g := ms["nodes.growth."+f.key]; g > 0 {
			t.Ratio, t.Measured, t.Met = g, true, g <= flatInN
		}
		if f.key == "cache" && !t.Measured && ms["nodes.hi"] > 0 {
			t.Why = "dirpv exports no cache size"
		}
		out = append(out, t)
	}
	return out
}

// maxOf is the largest of the figures whose name starts with prefix, and whether there is one.
func maxOf(ms map[string]float64, prefix string) (float64, bool) {
	var v float64
	found := false
	for k, x := range ms {
		if strings.HasPrefix(k, prefix) {
			v, found = max(v, x), true
		}
	}
	return v, found
}

// printTargets prints the targets table.
func printTargets(ts []Target) {
	fmt.Println("\ntargets:")
	fmt.Printf("| %-62s | %-26s | %10s | %7s | %-12s |\n", "figure", "target", "measured", "ratio", "status")
	fmt.Printf("|%s|%s|%s|%s|%s|\n", strings.Repeat("-", 64), strings.Repeat("-", 28), strings.Repeat("-", 12), strings.Repeat("-", 9), strings.Repeat("-", 14))
	for _, t := range ts {
		val, ratio := "", ""
		if t.Measured && t.Unit != "" {
			val = fmt.Sprintf("%.1f %s", t.Value, t.Unit)
		}
		if t.Measured {
			ratio = fmt.Sprintf("%.2fx", t.Ratio)
		}
		status := t.Status()
		if t.Why != "" {
			status += " (" + t.Why + ")"
		}
		fmt.Printf("| %-62s | %-26s | %10s | %7s | %-12s |\n", t.Figure, t.Target, val, ratio, status)
	}
}

// stock measures the stock-KCM row of the targets in the same run: it restarts
// kube-controller-manager with its own client limits (20/30), binds n claims through the ideal
// external provisioner and then through dirpv, as the main run does with KCM unthrottled, and
// restarts it as it was. It runs last: its claims stay.
func (b *bench) stock() error {
	if *flagKCM == "stock" {
		fmt.Println("   (the main run is the stock case already)")
		return nil
	}
	if err := b.s.Cluster.RestartControllerManager(b.ctx, nil); err != nil {
		return err
	}
	defer func() {
		if err := b.s.Cluster.RestartControllerManager(b.ctx, b.report.KCMArgs); err != nil {
			fmt.Printf("   (restore kube-controller-manager %v: %v)\n", b.report.KCMArgs, err)
		}
	}()
	if err := b.createClass(framework.NewClass("bench-ideal-stock", nil, framework.Provisioner(idealName))); err != nil {
		return err
	}
	if err := b.localClass("bench-local-stock", filepath.Join(b.s.Work.Dir, "base-stock")); err != nil {
		return err
	}
	stop, err := benchkit.StartIdeal(b.ctx, b.client, idealName, "")
	if err != nil {
		return err
	}
	d, err := b.bulk("stock-ideal", "bench-ideal-stock", nodeName, *flagN)
	if err = errors.Join(err, stop()); err != nil {
		return err
	}
	b.ms["stock.ideal.bulk"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("stock KCM: ideal external, %d claims", *flagN), Value: d.Seconds(), Unit: "s"})
	if d, err = b.bulk("stock-local", "bench-local-stock", nodeName, *flagN); err != nil {
		return err
	}
	b.ms["stock.local.bulk"] = d.Seconds()
	b.add(Row{Name: fmt.Sprintf("stock KCM: dirpv local, %d claims", *flagN), Value: d.Seconds(), Unit: "s",
		Ref: "ideal external", RefValue: b.ms["stock.ideal.bulk"]})
	return nil
}
