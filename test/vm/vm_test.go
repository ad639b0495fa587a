package vm

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/procfs"
)

// These tests boot the VM; `make test-vm` runs them. They fail, with the reason, wherever the
// VM cannot start.

func prepare(t *testing.T) *Image {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	img, err := Prepare(ctx, os.Stderr) // a cold start prints its progress at once
	if err != nil {
		t.Fatalf("the VM cannot start on this machine: %v", err)
	}
	return img
}

// TestRunReturnsStatusOutputAndFiles: a guest command's exit status, output and result files
// come back, its environment arrives unmangled, the guest has the kernel it was booted with,
// and nothing is left on the host.
func TestRunReturnsStatusOutputAndFiles(t *testing.T) {
	img := prepare(t)
	before := shareDirs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	res, err := Run(ctx, img, Command{Env: []string{"GREETING=it's $me"}, Args: []string{"sh", "-c",
		`uname -r; echo "$DIRPV_IN_VM" > "$DIRPV_VM_RESULTS/in-vm"; mkdir "$DIRPV_VM_RESULTS/sub"; echo "$GREETING" > "$DIRPV_VM_RESULTS/sub/b"; exit 3`}})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("boot %v, command %v", res.Boot, res.Run)
	if res.ExitCode != 3 {
		t.Errorf("exit status %d, want 3; output:\n%s", res.ExitCode, res.Output)
	}
	if got := strings.TrimSpace(string(res.Output)); got != img.Version {
		t.Errorf("guest's uname -r = %q, want %q", got, img.Version)
	}
	if string(res.Files["in-vm"]) != "1\n" || string(res.Files["sub/b"]) != "it's $me\n" || len(res.Files) != 2 {
		t.Errorf("result files = %q", res.Files)
	}
	checkNothingLeft(t, before)
}

// TestKernel builds the guest-side tests of package kernel, runs them in the VM and passes if
// they do. DIRPV_VM_RUN passes a -test.run pattern to them.
func TestKernel(t *testing.T) {
	img := prepare(t)
	before := shareDirs(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	tst := GoTest{Package: "github.com/dirpv/dirpv/test/vm/kernel", Timeout: 15 * time.Minute, Output: t.Output()}
	if run := os.Getenv("DIRPV_VM_RUN"); run != "" {
		tst.Flags = []string{"-test.run", run}
	}
	res, err := RunTest(ctx, img, tst)
	if err != nil {
		t.Fatalf("running the guest tests: %v", err)
	}
	t.Logf("guest: boot %v, tests %v, exit status %d", res.Boot.Round(time.Second), res.Run.Round(time.Second), res.ExitCode)
	if res.ExitCode != 0 {
		var failed []string
		for _, l := range strings.Split(string(res.Output), "\n") {
			if strings.Contains(l, "--- FAIL") {
				failed = append(failed, strings.TrimSpace(l))
			}
		}
		t.Fatalf("guest tests failed (exit status %d): %v\nguest console (kernel messages):\n%s", res.ExitCode, failed, LastLines(res.Console, 40))
	}
	if !bytes.Contains(res.Output, []byte("--- PASS")) {
		t.Fatalf("the guest ran no test")
	}
	checkNothingLeft(t, before)
}

// checkNothingLeft: no qemu child of this process and no share directory created since before.
func checkNothingLeft(t *testing.T, before []string) {
	t.Helper()
	if pids := qemuChildren(); len(pids) > 0 {
		t.Errorf("qemu still running after Run returned: pids %v", pids)
	}
	for _, d := range shareDirs(t) {
		if !slices.Contains(before, d) {
			t.Errorf("share dir %s left on the host", d)
		}
	}
}

// shareDirs lists this process's share directories (ownedTempDir names them by PID): another
// test binary's guest may run meanwhile, e.g. a node of package node.
func shareDirs(t *testing.T) []string {
	t.Helper()
	dirs, err := filepath.Glob(filepath.Join(os.TempDir(), "dirpv-vm-"+strconv.Itoa(os.Getpid())+"-*"))
	if err != nil {
		t.Fatal(err)
	}
	return dirs
}

// qemuChildren lists this process's qemu children (any state but reaped).
func qemuChildren() []int {
	procs, _ := procfs.AllProcs()
	var pids []int
	for _, p := range procs {
		if st, err := p.Stat(); err == nil && st.PPID == os.Getpid() && strings.Contains(st.Comm, "qemu") {
			pids = append(pids, p.PID)
		}
	}
	return pids
}
