package deploy

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// PrometheusRuleAPI is the kind the chart renders the alerts as, only where the cluster serves it.
const PrometheusRuleAPI = "monitoring.coreos.com/v1/PrometheusRule"

// TestMetricNames: the extractor finds the metrics of the expression forms the dashboard and
// the alerts use, and nothing else.
func TestMetricNames(t *testing.T) {
	for _, tc := range []struct {
		expr string
		want []string
	}{
		{`up`, []string{"up"}},
		{`max by (namespace, pod, export) (dirpv_nfs_export_saturated) == 1`, []string{"dirpv_nfs_export_saturated"}},
		{`histogram_quantile(0.99, sum by (le, backend) (rate(a_bucket{job=~"$job",le!="+Inf"}[$__rate_interval])))`, []string{"a_bucket"}},
		{`sum(rate(a_total{result=~"error|in_background"}[15m])) by (pod) > 0`, []string{"a_total"}},
		{"min_over_time(a[1h:5m]) > 0 and delta(b[1h] offset 5m) >= 0 unless c", []string{"a", "b", "c"}},
		{`(x / y < 0.1) and on (namespace, persistentvolumeclaim) (z * on (storageclass) group_left () w{provisioner="dirpv.io"})`, []string{"w", "x", "y", "z"}},
		{`a > bool 1e3 or ignoring(job) b:recorded:rate5m`, []string{"a", "b:recorded:rate5m"}},
		{`label_replace(a, "dst", "$1", "src", "(.*)")`, []string{"a"}},
		{`sum without (instance) (a) * on(x) group_right(y, z) b`, []string{"a", "b"}},
		{`{__name__="a"}`, nil},
	} {
		if got := MetricNames(tc.expr); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("MetricNames(%s) = %q, want %q", tc.expr, got, tc.want)
		}
	}
}

// TestMonitoringNamesLookServed: every metric the dashboard or an alert names is dirpv's own
// (test/integration's TestMonitoringMetricsAreServed checks them against real scrapes) or
// one of ExternalMetrics, and every one of those is still used.
func TestMonitoringNamesLookServed(t *testing.T) {
	exprs, err := MonitoringExprs(repoPath(t, "."))
	must(t, err)
	used := map[string]bool{}
	for where, e := range exprs {
		names := MetricNames(e)
		if len(names) == 0 {
			t.Errorf("%s: %q names no metric", where, e)
		}
		for _, n := range names {
			used[n] = true
			if _, ok := ExternalMetrics[n]; !ok && !regexp.MustCompile(`^(dirpv|process|go)_`).MatchString(n) {
				t.Errorf("%s names %s, which neither dirpv serves nor ExternalMetrics lists", where, n)
			}
		}
	}
	for n := range ExternalMetrics {
		if !used[n] {
			t.Errorf("ExternalMetrics lists %s, which nothing uses", n)
		}
	}
}

// TestMonitoringOption: the monitoring option's dashboard ConfigMap (what else it adds and that
// the chart's monitoring.enabled renders the same: TestHelmMatchesKustomize) is what Grafana
// picks up; off by default; the chart renders the rule only where the cluster serves its
// kind, and with the labels a Prometheus selects by.
func TestMonitoringOption(t *testing.T) {
	kustomize, helm := tools(t)
	withComponent := kustomizeObjs(t, kustomize, "test/deploy/testdata/monitoring")
	cm := withComponent["ConfigMap dirpv/dirpv-dashboard"]
	if cm.GetLabels()["grafana_dashboard"] != "1" {
		t.Errorf("dashboard ConfigMap labels %v: Grafana's sidecar looks for grafana_dashboard: \"1\"", cm.GetLabels())
	}
	dash, _, _ := unstructured.NestedString(cm.Object, "data", "dirpv.json")
	if !json.Valid([]byte(dash)) {
		t.Errorf("the ConfigMap's dirpv.json is not JSON")
	}

	if got := helmObjs(t, helm, nil).ofKind("ConfigMap"); len(got) != 0 {
		t.Errorf("monitoring is off by default, yet the chart renders ConfigMaps %v", got)
	}
	if got := helmObjs(t, helm, nil, "monitoring.enabled=true").keys(); !slices.Contains(got, "ConfigMap dirpv/dirpv-dashboard") ||
		slices.ContainsFunc(got, func(k string) bool { return strings.HasPrefix(k, "PrometheusRule ") }) {
		t.Errorf("monitoring.enabled on a cluster without %s: %v, want the dashboard and no PrometheusRule", PrometheusRuleAPI, got)
	}
	out, err := HelmTemplateFor(t.Context(), helm, "dirpv", []string{PrometheusRuleAPI}, nil, "monitoring.enabled=true", "monitoring.ruleLabels.release=prom")
	must(t, err)
	rule, ok := decode(t, out)["PrometheusRule dirpv/dirpv"]
	if !ok || rule.GetLabels()["release"] != "prom" {
		t.Errorf("monitoring.ruleLabels.release=prom: PrometheusRule %v", rule)
	}
}

// TestAlertsSayWhatToDo: every alert has a severity, a summary, a description and a
// runbook_url that leads to a heading of a page in docs/ that exists in this checkout.
func TestAlertsSayWhatToDo(t *testing.T) {
	rules, err := ReadRules(repoPath(t, "."))
	must(t, err)
	const prefix = "https://github.com/dirpv/dirpv/blob/main/"
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("rule %q: want an alert name, a severity, a summary and a description", r.Alert)
			}
			file, anchor, ok := strings.Cut(strings.TrimPrefix(r.Annotations["runbook_url"], prefix), "#")
			if !ok || !strings.HasPrefix(r.Annotations["runbook_url"], prefix) {
				t.Errorf("%s: runbook_url %q is not %s<file>#<section>", r.Alert, r.Annotations["runbook_url"], prefix)
				continue
			}
			if !strings.HasPrefix(file, "docs/") || !strings.HasSuffix(file, ".md") || strings.Contains(file, "..") {
				t.Errorf("%s: runbook_url names %s, not a page in docs/", r.Alert, file)
				continue
			}
			data, err := os.ReadFile(repoPath(t, file))
			if err != nil {
				t.Errorf("%s: runbook_url names %s: %v", r.Alert, file, err)
				continue
			}
			if !slices.Contains(headingAnchors(string(data)), anchor) {
				t.Errorf("%s: runbook_url: %s has no section #%s", r.Alert, file, anchor)
			}
		}
	}
	if n == 0 {
		t.Fatal("no alerts")
	}
}

// TestRulesPromtool: the PrometheusRule's rules pass `promtool check rules` and the unit tests
// in testdata/monitoring/rules_test.yaml (`promtool test rules`). promtool is Debian's, which
// make test-unit puts in ~/.cache/dirpv/tools (monitoring-tools); one on PATH is used first.
func TestRulesPromtool(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		home, _ := os.UserHomeDir()
		promtool = filepath.Join(home, ".cache", "dirpv", "tools", "promtool")
		if _, serr := os.Stat(promtool); serr != nil {
			t.Fatalf("promtool is neither on PATH (%v) nor at %s: run make monitoring-tools", err, promtool)
		}
	}
	rules, err := ReadRules(repoPath(t, "."))
	must(t, err)
	data, err := yaml.Marshal(rules)
	must(t, err)
	dir := t.TempDir()
	must(t, os.WriteFile(filepath.Join(dir, "rules.yaml"), data, 0o644))
	tests, err := os.ReadFile("testdata/monitoring/rules_test.yaml")
	must(t, err)
	must(t, os.WriteFile(filepath.Join(dir, "rules_test.yaml"), tests, 0o644))
	for _, args := range [][]string{{"check", "rules", "rules.yaml"}, {"test", "rules", "rules_test.yaml"}} {
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}
