package main

import (
	"os"
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
