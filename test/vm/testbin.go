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

// RunTest builds tst.Package's test binary on the host (go test -c, not under /tmp, which
// the guest replaces with its own tmpfs), runs it with -test.v in the guest from the package's
// directory (as go test does) and returns the guest's Result. A failing test is a Result with
// a non-zero ExitCode.
func RunTest(ctx context.Context, img *Image, tst GoTest) (*Result, error) {
	out, err := exec.CommandContext(ctx, "go", "list", "-f", "{{.Dir}}", tst.Package).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("vm: go list %s: %w\n%s", tst.Package, err, out)
	}
	pkgDir := strings.TrimSpace(string(out))
	dir, err := SharedDir("testbin-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	bin := filepath.Join(dir, filepath.Base(pkgDir)+".test")
	if out, err := exec.CommandContext(ctx, "go", "test", "-c", "-o", bin, tst.Package).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("vm: go test -c %s: %w\n%s", tst.Package, err, out)
	}
	if tst.Timeout <= 0 {
		tst.Timeout = DefaultTimeout
	}
	args := append([]string{bin, "-test.v", "-test.timeout", tst.Timeout.String()}, tst.Flags...)
	return Run(ctx, img, Command{Args: args, Dir: pkgDir, BootTimeout: tst.BootTimeout,
		Timeout: tst.Timeout + time.Minute, Output: tst.Output})
}
