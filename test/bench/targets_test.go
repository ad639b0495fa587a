package main

import (
	"math"
	"testing"
)

func targetByFigure(t *testing.T, ts []Target, figure string) Target {
	t.Helper()
	for _, x := range ts {
		if x.Figure == figure {
			return x
		}
	}
	t.Fatalf("no target %q in %+v", figure, ts)
	return Target{}
}

// Every row of the targets table is there, whether measured or not, and each status follows
// from the figures the phases recorded.
func TestTargets(t *testing.T) {
	ms := map[string]float64{
		"rss.node.provisioning 1000":        34, // MiB: 35.7 MB, met
		"rss.node.restarted over 1000":      36, // MiB: 37.7 MB, the max, met
		"rss.controller.provisioning 1000":  40, // MiB: 41.9 MB, missed
		"heap.node.provisioning 1000":       3,
		"heap.controller.provisioning 1000": 9,
		"stock.ideal.bulk":                  100, "stock.local.bulk": 98,
		"ideal.bulk": 20, "local.bulk": 23,
		"ideal.p50": 50, "local.p50": 57,
		"nodes.lo": 10, "nodes.hi": 100, "nodes.growth.peak": 1.02, "nodes.growth.heap": 1.4, "nodes.growth.watches": 1,
	}
	ts := buildTargets(ms, 1000, 500, "fast")
	if len(ts) != 11 {
		t.Errorf("%d rows, want 11: %+v", len(ts), ts)
	}
	for figure, want := range map[string]string{
		"node peak RSS at 1000 PVs":                                    "met",
		"controller peak RSS at 1000 PVs":                              "missed",
		"node Go heap growth per 1000 PVs":                             "met",
		"controller Go heap growth per 1000 PVs":                       "missed",
		"500 claims create->all Bound, stock KCM":                      "met",
		"500 claims create->all Bound, KCM unthrottled":                "missed",
		"single claim p50, KCM unthrottled":                            "met",
		"N=100 vs N=10 simulated nodes: per-node peak RSS":             "met",
		"N=100 vs N=10 simulated nodes: per-node Go heap (its caches)": "missed",
		"N=100 vs N=10 simulated nodes: per-node cached objects":       "not measured",
		"N=100 vs N=10 simulated nodes: API server WATCHes per node":   "met",
	} {
		if got := targetByFigure(t, ts, figure).Status(); got != want {
			t.Errorf("%s: %s, want %s", figure, got, want)
		}
	}
	if v := targetByFigure(t, ts, "node peak RSS at 1000 PVs").Value; math.Abs(v-37.75) > 0.01 {
		t.Errorf("node peak RSS = %.2f MB, want the max of the phases, 36 MiB = 37.75 MB", v)
	}
	if r := targetByFigure(t, ts, "500 claims create->all Bound, stock KCM").Ratio; r != 0.98 {
		t.Errorf("stock ratio %v, want 0.98", r)
	}
}

func TestTargetsNotMeasured(t *testing.T) {
	ts := buildTargets(map[string]float64{}, 1000, 500, "fast")
	for _, x := range ts {
		if x.Status() != "not measured" {
			t.Errorf("%s: %s with no figures", x.Figure, x.Status())
		}
	}
	// Run with -kcm stock, the main run is the stock case and the unthrottled rows are not.
	ts = buildTargets(map[string]float64{"ideal.bulk": 100, "local.bulk": 101}, 1000, 200, "stock")
	if got := targetByFigure(t, ts, "200 claims create->all Bound, stock KCM").Status(); got != "missed" {
		t.Errorf("stock row with the main run's figures: %s, want missed (1.01x)", got)
	}
	if got := targetByFigure(t, ts, "200 claims create->all Bound, KCM unthrottled").Status(); got != "not measured" {
		t.Errorf("unthrottled row in a stock run: %s", got)
	}
}
