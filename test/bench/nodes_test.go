package main

import (
	"slices"
	"testing"
)

func TestParseNodeCounts(t *testing.T) {
	for in, want := range map[string][]int{
		"50":          {50},
		"100,10, 50":  {10, 50, 100},
		"10,10,50,":   {10, 50},
		" 1 , 2 ,3  ": {1, 2, 3},
	} {
		got, err := parseNodeCounts(in)
		if err != nil || !slices.Equal(got, want) {
			t.Errorf("parseNodeCounts(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", ",", "0", "-5", "ten", "10,x"} {
		if got, err := parseNodeCounts(in); err == nil {
			t.Errorf("parseNodeCounts(%q) = %v, want an error", in, got)
		}
	}
}

// The API server's WATCH count is the sum over its series with verb="WATCH", and no other
// metric that merely starts with the same name counts.
func TestSumSamples(t *testing.T) {
	const text = `# HELP apiserver_longrunning_requests [STABLE] Gauge of all active long-running apiserver requests
# TYPE apiserver_longrunning_requests gauge
apiserver_longrunning_requests{component="apiserver",group="",resource="persistentvolumeclaims",scope="cluster",subresource="",verb="WATCH",version="v1"} 12
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="log",verb="CONNECT",version="v1"} 2
apiserver_longrunning_requests{component="apiserver",group="",resource="persistentvolumes",scope="cluster",subresource="",verb="WATCH",version="v1"} 30
apiserver_longrunning_requests_total{verb="WATCH"} 1000
go_memstats_heap_inuse_bytes 1.048576e+07
`
	if got := sumSamples(text, "apiserver_longrunning_requests", `verb="WATCH"`); got != 42 {
		t.Errorf("WATCH requests = %v, want 42", got)
	}
	if got := sumSamples(text, "apiserver_longrunning_requests"); got != 44 {
		t.Errorf("all long-running requests = %v, want 44", got)
	}
	if got := sumSamples(text, "go_memstats_heap_inuse_bytes"); got != 1<<20*10 {
		t.Errorf("heap = %v, want %v", got, 1<<20*10)
	}
	if got := sumSamples(text, "missing"); got != 0 {
		t.Errorf("missing metric = %v, want 0", got)
	}
}

func TestSummariseMedianAndMax(t *testing.T) {
	var r nodesResult
	r.summarise([]nodeCount{
		{peakMiB: 40, rssMiB: 30, heapMiB: 8, cached: map[string]float64{"dirpv_informer_objects": 4}},
		{peakMiB: 44, rssMiB: 31, heapMiB: 9, cached: map[string]float64{"dirpv_informer_objects": 8}},
		{peakMiB: 60, rssMiB: 35, heapMiB: 20, cached: map[string]float64{"dirpv_informer_objects": 5}},
		{peakMiB: 42, rssMiB: 33, heapMiB: 7, cached: map[string]float64{"dirpv_informer_objects": 6}},
	})
	if r.PeakMed != 43 || r.PeakMax != 60 || r.RSSMed != 32 || r.RSSMax != 35 || r.HeapMed != 8.5 || r.HeapMax != 20 {
		t.Errorf("summarise: %+v", r)
	}
	if r.Cached["dirpv_informer_objects"] != 5.5 || r.CachedMax["dirpv_informer_objects"] != 8 || r.CachedTotal["dirpv_informer_objects"] != 23 {
		t.Errorf("cached median, max, total = %v, %v, %v, want 5.5, 8, 23", r.Cached, r.CachedMax, r.CachedTotal)
	}
}
