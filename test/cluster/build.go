package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Build runs build.sh, which builds (cold: ~15 min on 2 cores) or reuses (warm: seconds) etcd
// and the Kubernetes binaries in a version-keyed cache outside the repo, and returns their
// directory. Progress goes to stderr. If another build.sh is already filling the cache, this
// one rebuilds the missing binaries itself; callers should not start two at once.
func Build(ctx context.Context) (string, error) {
	return runBuild(ctx, os.Stderr)
}

// BuildE2E is Build plus Kubernetes' own e2e.test and a static agnhost, built from the same
// module at the same version into the same directory (cold: a further ~25 min).
func BuildE2E(ctx context.Context) (string, error) {
	return runBuild(ctx, os.Stderr, "e2e")
}

// ErrNotBuilt is returned by CachedBinDir when the binaries are not in the cache yet.
var ErrNotBuilt = errors.New("kubernetes binaries not built yet: run test/cluster/build.sh (cold: ~15 min)")

// CachedBinDir returns the binary directory if everything is built already, without building.
// Tests use it to skip (with a reason) rather than spend a cold build inside `go test`.
func CachedBinDir(ctx context.Context) (string, error) {
	var stderr bytes.Buffer
	dir, err := runBuild(ctx, &stderr, "--check")
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.ExitCode() == 2 {
		return "", fmt.Errorf("%w: %s", ErrNotBuilt, strings.TrimSpace(stderr.String()))
	}
	return dir, err
}

func runBuild(ctx context.Context, stderr io.Writer, args ...string) (string, error) {
	dir, err := sourceDir()
	if err != nil {
		return "", err
	}
	var stdout bytes.Buffer
	cmd := exec.CommandContext(ctx, "bash", append([]string{filepath.Join(dir, "build.sh")}, args...)...)
	cmd.Stdout = &stdout
	cmd.Stderr = stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("build.sh: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	bin := strings.TrimSpace(lines[len(lines)-1])
	if st, err := os.Stat(bin); err != nil || !st.IsDir() {
		return "", fmt.Errorf("build.sh printed %q, not a directory", bin)
	}
	return bin, nil
}
