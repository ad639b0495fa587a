package benchkit

import "testing"

// The API server's WATCH count is the sum over its series with verb="WATCH", and no other
// metric that merely starts with the same name counts.
func TestSum(t *testing.T) {
	m := ParseMetrics(`# HELP apiserver_longrunning_requests [STABLE] Gauge of all active long-running apiserver requests
# TYPE apiserver_longrunning_requests gauge
apiserver_longrunning_requests{component="apiserver",group="",resource="persistentvolumeclaims",scope="cluster",subresource="",verb="WATCH",version="v1"} 12
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="log",verb="CONNECT",version="v1"} 2
apiserver_longrunning_requests{component="apiserver",group="",resource="persistentvolumes",scope="cluster",subresource="",verb="WATCH",version="v1"} 30
apiserver_longrunning_requests_total{verb="WATCH"} 1000
go_memstats_heap_inuse_bytes 1.048576e+07
`)
	for _, c := range []struct {
		name, label string
		want        float64
	}{
		{"apiserver_longrunning_requests", `verb="WATCH"`, 42},
		{"apiserver_longrunning_requests", "", 44},
		{"go_memstats_heap_inuse_bytes", "", 1 << 20 * 10},
		{"missing", "", 0},
	} {
		if got := Sum(m, c.name, c.label); got != c.want {
			t.Errorf("Sum(%s, %q) = %v, want %v", c.name, c.label, got, c.want)
		}
	}
}
