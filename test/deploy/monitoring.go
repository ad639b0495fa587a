package deploy

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// MonitoringDir holds the dashboard and the alerts, relative to the repository (the chart's
// files/monitoring holds copies).
const MonitoringDir = "deploy/components/monitoring"

// ExternalMetrics are the metrics the dashboard and the alerts read that dirpv does not serve,
// by what serves them: a scrape of dirpv cannot show them, so they are listed here on purpose.
var ExternalMetrics = map[string]string{
	"kubelet_volume_stats_available_bytes": "kubelet",
	"kubelet_volume_stats_capacity_bytes":  "kubelet",
	"kube_persistentvolumeclaim_info":      "kube-state-metrics",
	"kube_storageclass_info":               "kube-state-metrics",
}

// Rule is one alerting rule of deploy/components/monitoring/prometheusrule.yaml.
type Rule struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	For         string            `json:"for,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// RuleGroups is the spec of a PrometheusRule, which is also a Prometheus rule file.
type RuleGroups struct {
	Groups []struct {
		Name  string `json:"name"`
		Rules []Rule `json:"rules"`
	} `json:"groups"`
}

// ReadRules returns the PrometheusRule's spec under repo.
func ReadRules(repo string) (*RuleGroups, error) {
	data, err := os.ReadFile(filepath.Join(repo, MonitoringDir, "prometheusrule.yaml"))
	if err != nil {
		return nil, err
	}
	var obj struct {
		APIVersion string         `json:"apiVersion"`
		Kind       string         `json:"kind"`
		Metadata   map[string]any `json:"metadata"`
		Spec       RuleGroups     `json:"spec"`
	}
	if err := yaml.UnmarshalStrict(data, &obj); err != nil {
		return nil, fmt.Errorf("prometheusrule.yaml: %w", err)
	}
	return &obj.Spec, nil
}

// MonitoringExprs returns every PromQL expression of the dashboard's panels and variables and
// of the alerts under repo, keyed by where it is ("panel <title> <refId>", "variable <name>",
// "alert <name>").
func MonitoringExprs(repo string) (map[string]string, error) {
	exprs := map[string]string{}
	rules, err := ReadRules(repo)
	if err != nil {
		return nil, err
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			exprs["alert "+r.Alert] = r.Expr
		}
	}
	data, err := os.ReadFile(filepath.Join(repo, MonitoringDir, "dashboard.json"))
	if err != nil {
		return nil, err
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		return nil, fmt.Errorf("dashboard.json: %w", err)
	}
	for _, p := range dash.Panels {
		for _, t := range p.Targets {
			exprs[fmt.Sprintf("panel %q %s", p.Title, t.RefID)] = t.Expr
		}
	}
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			return nil, fmt.Errorf("dashboard.json: variable %s: %w", v.Name, err)
		}
		// label_values(<selector>, <label>): only the selector is PromQL.
		m := labelValues.FindStringSubmatch(q.Query)
		if m == nil {
			return nil, fmt.Errorf("dashboard.json: variable %s: query %q is not label_values(<selector>, <label>)", v.Name, q.Query)
		}
		exprs["variable "+v.Name] = m[1]
	}
	return exprs, nil
}

var labelValues = regexp.MustCompile(`^\s*label_values\(\s*(.+?)\s*,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)\s*$`)

var (
	// Strings, then label matchers and range or subquery brackets, hold no metric name.
	promString   = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`")
	promBraces   = regexp.MustCompile(`\{[^{}]*\}|\[[^\[\]]*\]`)
	promGrouping = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`)
	// A word that can be a metric name, with what comes right before and after it.
	promWord = regexp.MustCompile(`[$.0-9]*[a-zA-Z_:][a-zA-Z0-9_:]*\s*\(?`)
)

// promKeywords are PromQL's words that are neither functions nor metrics.
var promKeywords = []string{"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
	"group_left", "group_right", "inf", "nan", "atan2"}

// MetricNames returns the metric names a PromQL expression selects, sorted and once each.
//
// Not Prometheus's own parser (github.com/prometheus/prometheus/promql/parser): that module is
// Prometheus's whole server, whose go.mod would put cloud SDKs and Kubernetes versions of its own
// into dirpv's module graph for one test. The expressions here are ours and the extractor's own
// test covers the forms they use: strings, label matchers, ranges and grouping clauses are
// removed, then a word is a metric unless it calls (a function or aggregation), is a keyword,
// a number or a duration, or is a Grafana variable ($x).
func MetricNames(expr string) []string {
	s := promString.ReplaceAllString(expr, " ")
	for {
		t := promBraces.ReplaceAllString(s, " ")
		if t == s {
			break
		}
		s = t
	}
	s = promGrouping.ReplaceAllString(s, " ")
	var names []string
	for _, w := range promWord.FindAllString(s, -1) {
		if strings.HasSuffix(w, "(") || strings.ContainsAny(w[:1], "$.0123456789") {
			continue
		}
		w = strings.TrimSpace(w)
		if slices.Contains(promKeywords, strings.ToLower(w)) {
			continue
		}
		names = append(names, w)
	}
	slices.Sort(names)
	return slices.Compact(names)
}
