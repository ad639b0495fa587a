// Package metricstest reads figures back from a Prometheus registry in tests.
package metricstest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// HistogramCount returns the number of observations of the histogram name with exactly the
// given labels, 0 if there is none.
func HistogramCount(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) uint64 {
	t.Helper()
	return find(t, g, name, labels).GetHistogram().GetSampleCount()
}

// Value returns the value of the gauge or counter name with exactly the given labels, 0 if
// there is none.
func Value(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	m := find(t, g, name, labels)
	if m.GetGauge() != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetCounter().GetValue()
}

// find returns the metric name with exactly the given labels, nil if there is none (whose
// getters return zeros).
func find(t testing.TB, g prometheus.Gatherer, name string, labels map[string]string) *dto.Metric {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if labelsEqual(m.GetLabel(), labels) {
				return m
			}
		}
	}
	return nil
}

func labelsEqual(got []*dto.LabelPair, want map[string]string) bool {
	if len(got) != len(want) {
		return false
	}
	for _, l := range got {
		if want[l.GetName()] != l.GetValue() {
			return false
		}
	}
	return true
}
