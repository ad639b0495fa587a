package main

import (
	"math"
	"net/http"
	"net/http/httptest"
	"net/http/pprof"
	"os"
	"runtime"
	"testing"
)

// pageOutBinary makes the kernel drop the resident pages of a process's executable, and
// residentBySection sees it: the two together are how the bench tells the binary's working
// set from what only startup touched.
func TestPageOutBinaryDropsResidentPages(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	resident := func() uint64 {
		secs, err := residentBySection(os.Getpid(), exe)
		if err != nil {
			t.Fatal(err)
		}
		var sum uint64
		for _, s := range secs {
			if s.Name == ".rodata" || s.Name == ".gopclntab" {
				sum += s.Resident
			}
		}
		return sum
	}
	before := resident()
	if before == 0 {
		t.Fatalf("no resident pages of %s before the page-out", exe)
	}
	if err := pageOutBinary(os.Getpid()); err != nil {
		t.Fatal(err)
	}
	if after := resident(); after >= before/2 {
		t.Errorf("resident .rodata+.gopclntab of the test binary: %d bytes before MADV_PAGEOUT, %d after; want less than half", before, after)
	}
}

// heapStats reads the live heap of a process serving pprof: 32 MiB held live shows in it, and
// is gone from it once dropped, whatever garbage is around.
func TestHeapStatsIsLiveHeap(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	const held = 32 << 20
	live := make([]byte, held)
	for i := range live {
		live[i] = 1
	}
	with, inuse, err := heapStats(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if with < held || inuse < with {
		t.Fatalf("with %d bytes held: HeapAlloc %.0f, HeapInuse %.0f; want HeapInuse >= HeapAlloc >= %d", held, with, inuse, held)
	}
	runtime.KeepAlive(live)
	live = nil
	without, _, err := heapStats(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if with-without < held/2 {
		t.Errorf("HeapAlloc %.0f with %d bytes held, %.0f after dropping them; want the difference after a GC", with, held, without)
	}
}

// The rss phase's figures reach the JSON report under the names the targets summary reads:
// each process's largest peak and heap growth over the phase, the growth per 1000 PVs whatever
// -rss-n was, and both as ratios to their targets.
func TestMemoryFigures(t *testing.T) {
	defer func(n int) { *flagRSSN = n }(*flagRSSN)
	*flagRSSN = 500
	b := &bench{ms: map[string]float64{
		"rss.floor":                        28,
		"rss.node.provisioning 500":        58,
		"rss.node.restarted over 500":      46,
		"heap.node.provisioning 500":       5,
		"heap.node.restarted over 500":     3,
		"rss.controller.provisioning 500":  40,
		"heap.controller.provisioning 500": 2,
		"cpu.node.provisioning 500":        4.5,
		"ws.node":                          17,
	}}
	got := b.memoryFigures()
	for name, want := range map[string]float64{
		"floorRSSMiB":                       28,
		"nodePeakRSSMiB":                    58,
		"nodePeakRSSVsPeer":                 58 / peerRSSMiB,
		"nodeHeapGrowthMiBPer1000PVs":       10,
		"nodeHeapGrowthVsGoal":              10.0 / 8,
		"controllerPeakRSSMiB":              40,
		"controllerHeapGrowthMiBPer1000PVs": 4,
		"nodeCPUSecondsProvisioning":        4.5,
		"nodeBinaryWorkingSetMiB":           17,
		"peerRSSMiB":                        38e6 / (1 << 20),
		"heapGrowthGoalMiBPer1000PVs":       8,
		"pvs":                               500,
	} {
		if v, ok := got[name]; !ok || math.Abs(v-want) > 1e-9 {
			t.Errorf("memory[%q] = %v (present %v), want %v", name, v, ok, want)
		}
	}
}
