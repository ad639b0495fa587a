package main

import (
	"net/http"
	"net/http/httptest"
	"net/http/pprof"
	"os"
	"path/filepath"
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

// heapProfile reads the live heap of a process serving pprof: 32 MiB held live shows in it, and
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
	with, inuse, err := heapProfile(srv.URL, filepath.Join(t.TempDir(), "with"))
	if err != nil {
		t.Fatal(err)
	}
	if with < held || inuse < with {
		t.Fatalf("with %d bytes held: HeapAlloc %.0f, HeapInuse %.0f; want HeapInuse >= HeapAlloc >= %d", held, with, inuse, held)
	}
	runtime.KeepAlive(live)
	live = nil
	without, _, err := heapProfile(srv.URL, filepath.Join(t.TempDir(), "without"))
	if err != nil {
		t.Fatal(err)
	}
	if with-without < held/2 {
		t.Errorf("HeapAlloc %.0f with %d bytes held, %.0f after dropping them; want the difference after a GC", with, held, without)
	}
}
