package vm

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// TestBinary is a Go test binary built on the host for running in the guest.
type TestBinary struct {
	// Path is the binary. It is not under /tmp, which the guest replaces with its own tmpfs.
	Path string
	// Dir is the package's source directory, where go test would run the binary.
	Dir string
}

// BuildTest builds the test binary of pkg (an import path or ./relative package) with
// go test -c. cleanup removes it.
func BuildTest(ctx context.Context, pkg string) (_ *TestBinary, cleanup func(), err error) {
	dir, err := SharedDir("testbin-")
	if err != nil {
		return nil, nil, err
	}
	cleanup = func() { os.RemoveAll(dir) }
	defer func() {
		if err != nil {
			cleanup()
		}
	}()
	out, err := exec.CommandContext(ctx, "go", "list", "-f", "{{.Dir}}", pkg).CombinedOutput()
	if err != nil {
		return nil, nil, fmt.Errorf("vm: go list %s: %w\n%s", pkg, err, out)
	}
	bin := &TestBinary{Path: filepath.Join(dir, filepath.Base(strings.TrimSpace(string(out)))+".test"), Dir: strings.TrimSpace(string(out))}
	if out, err := exec.CommandContext(ctx, "go", "test", "-c", "-o", bin.Path, pkg).CombinedOutput(); err != nil {
		return nil, nil, fmt.Errorf("vm: go test -c %s: %w\n%s", pkg, err, out)
	}
	return bin, cleanup, nil
}

// GoTest is a Go test package to run in the guest with RunTest.
type GoTest struct {
	// Package is the import path or ./relative package.
	Package string
	// Flags are extra test flags (-test.run=...).
	Flags []string
	// Timeout is the test binary's -test.timeout; the guest command gets a minute more, so
	// that the binary's own timeout, which names the hanging test, fires first. 0 means
	// DefaultTimeout.
	Timeout time.Duration
	// BootTimeout and Output are as in Command.
	BootTimeout time.Duration
	Output      io.Writer
}

// RunTest builds tst.Package's test binary on the host, runs it with -test.v in the guest from
// the package's directory (as go test does) and returns the guest's Result. A failing test is
// a Result with a non-zero ExitCode.
func RunTest(ctx context.Context, img *Image, tst GoTest) (*Result, error) {
	bin, cleanup, err := BuildTest(ctx, tst.Package)
	if err != nil {
		return nil, err
	}
	defer cleanup()
	if tst.Timeout <= 0 {
		tst.Timeout = DefaultTimeout
	}
	args := append([]string{bin.Path, "-test.v", "-test.timeout", tst.Timeout.String()}, tst.Flags...)
	return Run(ctx, img, Command{Args: args, Dir: bin.Dir, BootTimeout: tst.BootTimeout,
		Timeout: tst.Timeout + time.Minute, Output: tst.Output})
}
