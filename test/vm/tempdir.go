package vm

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// ownedTempDir creates a temporary directory in parent named prefix<pid>-*, first removing
// those of earlier processes that are gone: a test binary killed by go test's -timeout runs
// no deferred cleanup (qemu dies with it through Pdeathsig, its directories stay).
func ownedTempDir(parent, prefix string) (string, error) {
	if parent == "" {
		parent = os.TempDir()
	}
	old, _ := filepath.Glob(filepath.Join(parent, prefix+"*"))
	for _, d := range old {
		pidStr, _, ok := strings.Cut(strings.TrimPrefix(filepath.Base(d), prefix), "-")
		pid, err := strconv.Atoi(pidStr)
		if !ok || err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat("/proc/" + pidStr); os.IsNotExist(err) {
			_ = os.RemoveAll(d)
		}
	}
	d, err := os.MkdirTemp(parent, prefix+strconv.Itoa(os.Getpid())+"-")
	if err != nil {
		return "", fmt.Errorf("vm: %w", err)
	}
	return d, nil
}

// SharedDir creates a directory on the host that the guest sees at the same path, for files
// the host prepares for a guest command (the guest's /tmp is its own tmpfs, so it is under
// CacheDir). The caller removes it; those of processes that are gone are removed by the next
// call.
func SharedDir(prefix string) (string, error) {
	cache, err := CacheDir()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", fmt.Errorf("vm: %w", err)
	}
	return ownedTempDir(cache, prefix)
}
