package main

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// procStatus reads the "<key>: <n> kB" lines of /proc/<pid>/status (VmHWM, VmRSS, RssAnon,
// RssFile), in MiB.
func procStatus(pid int) (map[string]float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(b), "\n") {
		key, rest, _ := strings.Cut(line, ":")
		if f := strings.Fields(rest); len(f) == 2 && f[1] == "kB" {
			if kb, err := strconv.ParseInt(f[0], 10, 64); err == nil {
				out[key] = float64(kb) / 1024
			}
		}
	}
	if _, ok := out["VmHWM"]; !ok {
		return nil, fmt.Errorf("/proc/%d/status has no VmHWM", pid)
	}
	return out, nil
}

// cpuTime is the user+system CPU time a process used so far.
func cpuTime(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command name, which is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	fs := strings.Fields(string(b[i+1:]))
	if len(fs) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(fs[11], 10, 64)
	st, _ := strconv.ParseInt(fs[12], 10, 64)
	const ticksPerSecond = 100 // USER_HZ on Linux
	return time.Duration(ut+st) * time.Second / ticksPerSecond
}

// residentBySection returns how many bytes of each loaded section of the ELF binary at path
// are resident in process pid (from /proc/<pid>/pagemap, which needs root), in file order.
// It tells which part of the binary's file-backed RSS is code (.text), constant data
// (.rodata) and the runtime's function tables (.gopclntab).
func residentBySection(pid int, path string) ([]sectionRSS, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	pm, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		return nil, err
	}
	defer pm.Close()
	page := uint64(os.Getpagesize())
	var out []sectionRSS
	for _, s := range f.Sections {
		if s.Type != elf.SHT_PROGBITS || s.Flags&elf.SHF_ALLOC == 0 || s.Size < page {
			continue
		}
		first, end := s.Addr/page, (s.Addr+s.Size+page-1)/page
		buf := make([]byte, (end-first)*8)
		if _, err := pm.ReadAt(buf, int64(first*8)); err != nil {
			return nil, fmt.Errorf("pagemap of %d: %w", pid, err)
		}
		var present uint64
		for i := 0; i < len(buf); i += 8 {
			// Bit 63 of each entry: the page is present in RAM.
			if binary.LittleEndian.Uint64(buf[i:])>>63 == 1 {
				present++
			}
		}
		out = append(out, sectionRSS{Name: s.Name, Size: s.Size, Resident: present * page})
	}
	return out, nil
}

type sectionRSS struct {
	Name           string
	Size, Resident uint64
}

// sectionsNote formats residentBySection's result for process pid and the binary at path,
// e.g. ".text 12.8/25.9 MiB, ...".
func sectionsNote(pid int, path string) string {
	secs, _ := residentBySection(pid, path)
	var parts []string
	for _, s := range secs {
		if s.Resident >= 1<<20 {
			parts = append(parts, fmt.Sprintf("%s %.1f/%.1f MiB", s.Name, float64(s.Resident)/(1<<20), float64(s.Size)/(1<<20)))
		}
	}
	return strings.Join(parts, ", ")
}

// pageOutBinary asks the kernel to reclaim the pages of pid's own executable that are mapped
// read-only (code, constants, function tables), with process_madvise(MADV_PAGEOUT). What
// faults back in afterwards is the binary's working set; the rest was touched only at startup.
func pageOutBinary(pid int) error {
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil {
		return err
	}
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return err
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	for _, line := range strings.Split(string(maps), "\n") {
		fs := strings.Fields(line)
		if len(fs) < 6 || fs[5] != exe || strings.Contains(fs[1], "w") {
			continue
		}
		var start, end uintptr
		if _, err := fmt.Sscanf(fs[0], "%x-%x", &start, &end); err != nil {
			return fmt.Errorf("maps line %q: %w", line, err)
		}
		// An iovec of the other process's address space: plain integers, never dereferenced here.
		iov := [2]uintptr{start, end - start}
		if _, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&iov)), 1, unix.MADV_PAGEOUT, 0, 0); errno != 0 {
			return fmt.Errorf("process_madvise %d %s: %w", pid, fs[0], errno)
		}
	}
	return nil
}

// copyUncached copies the executable src to dst (a new inode, not a link) and drops dst from
// the page cache, so that a process started from it reads it from disk as after a reboot.
// A freshly written file is cached in large folios, and a process mapping it then has whole
// folios resident: the entire binary, measured at 59 MiB here, instead of what it touches.
func copyUncached(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o755)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		return err
	}
	// Dirty pages cannot be dropped: write them out first.
	if err := f.Sync(); err != nil {
		return err
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("drop %s from the page cache: %w", dst, err)
	}
	return f.Close()
}

// heapProfile saves the heap profile of the dirpv process serving base (run with
// --profiling) to path, in pprof's text format, and returns its live heap (HeapAlloc) and its
// heap's spans in use (HeapInuse). The process runs a GC first (gc=1), so that the profile and
// both figures show the live heap: the text profile ends with the runtime.MemStats that the
// handler reads after that GC.
func heapProfile(base, path string) (alloc, inuse float64, err error) {
	hc := &http.Client{Timeout: 30 * time.Second}
	resp, err := hc.Get(base + "/debug/pprof/heap?gc=1&debug=1")
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, 0, fmt.Errorf("heap profile: %s (run dirpv with --profiling)", resp.Status)
	}
	body, err := io.ReadAll(resp.Body)
	if err == nil {
		err = os.WriteFile(path, body, 0o644)
	}
	if err != nil {
		return 0, 0, err
	}
	return parseMemStats(string(body))
}

// parseMemStats reads HeapAlloc and HeapInuse from a debug=1 heap profile.
func parseMemStats(profile string) (alloc, inuse float64, err error) {
	found := 0
	for _, line := range strings.Split(profile, "\n") {
		for name, dst := range map[string]*float64{"# HeapAlloc = ": &alloc, "# HeapInuse = ": &inuse} {
			if v, ok := strings.CutPrefix(line, name); ok {
				if *dst, err = strconv.ParseFloat(strings.TrimSpace(v), 64); err != nil {
					return 0, 0, fmt.Errorf("heap profile line %q: %w", line, err)
				}
				found++
			}
		}
	}
	if found != 2 {
		return 0, 0, errors.New("heap profile has no runtime.MemStats (HeapAlloc, HeapInuse)")
	}
	return alloc, inuse, nil
}

// quietShare is how little CPU the cluster's processes (etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler and dirpv's) use together, in a share of one CPU over
// settleWindow, when the cluster counts as settled.
const (
	quietShare   = 0.25
	settleWindow = time.Second
	settleMax    = 30 * time.Second
)

// settle waits until the cluster is quiet (quietShare in two windows in a row), at most
// settleMax, so that each timed run starts from the same state: without it a run right after
// the clean-up of an earlier one (a thousand claims and PVs deleted) meets the cluster still
// working off that, and measures the order of the phases more than what it times.
func (b *bench) settle(what string) {
	t0 := time.Now()
	used := func() time.Duration {
		var d time.Duration
		for name, c := range b.cpuSnapshot() {
			if name != "bench" {
				d += c
			}
		}
		return d
	}
	quiet := 0
	last := used()
	for quiet < 2 && time.Since(t0) < settleMax {
		select {
		case <-time.After(settleWindow):
		case <-b.ctx.Done():
			return
		}
		now := used()
		if float64(now-last) < quietShare*float64(settleWindow) {
			quiet++
		} else {
			quiet = 0
		}
		last = now
	}
	if quiet < 2 {
		fmt.Printf("   (%s: the cluster did not settle below %.0f%% of a CPU within %s; timing anyway)\n", what, 100*quietShare, settleMax)
		return
	}
	fmt.Printf("   (%s: cluster settled in %.1fs)\n", what, time.Since(t0).Seconds())
}
