package vm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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
	cache, err := CacheDir()
	if err != nil {
		return nil, nil, err
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, nil, fmt.Errorf("vm: %w", err)
	}
	dir, err := ownedTempDir(cache, "testbin-")
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
