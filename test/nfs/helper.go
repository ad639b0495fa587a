package nfs

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"

	"github.com/dirpv/dirpv/test/nfs/internal/mountrec"
)

// HelperPackage is the import path of the test-only mount helper.
const HelperPackage = "github.com/dirpv/dirpv/test/nfs/cmd/nfs-fuse-mount"

// MountRecord is what nfs-fuse-mount records about a live mount: notably
// Options, every -o option exactly as the mounter was given it.
type MountRecord = mountrec.Record

// ReadMountRecord returns the record of the nfs-fuse-mount mount at target
// (an error if there is none, e.g. after unmount). Use it to prove that
// mount options (a StorageClass's mountOptions, a PV's spec.mountOptions)
// reached the mount.
func ReadMountRecord(target string) (*MountRecord, error) { return mountrec.Read(target) }

// MountRecordPath is where the record for target lives
// (/run/dirpv-nfs-fuse/<first 8 bytes of sha256(target), hex>.json).
func MountRecordPath(target string) string { return mountrec.Path(target) }

var (
	buildMu   sync.Mutex
	builtPath string
)

// BuildMountHelper builds cmd/nfs-fuse-mount (once per process; the Go build
// cache makes later processes cheap) and returns the binary's path, for
// k8s.io/mount-utils' mount.New(path). The binary lands in
// $XDG_CACHE_HOME/dirpv-test (~/.cache/dirpv-test) via an atomic rename, so
// test binaries building at once never see a half-written file.
func BuildMountHelper(ctx context.Context) (string, error) {
	buildMu.Lock()
	defer buildMu.Unlock()
	if builtPath != "" {
		return builtPath, nil
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "dirpv-test")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("nfs: creating %s: %w", dir, err)
	}
	out := filepath.Join(dir, "nfs-fuse-mount")
	tmp, err := os.CreateTemp(dir, ".nfs-fuse-mount-*")
	if err != nil {
		return "", fmt.Errorf("nfs: creating temp file in %s: %w", dir, err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	// DIRPV_NFS_HELPER_BUILDFLAGS (e.g. "-race") is for debugging the helper.
	args := append([]string{"build", "-o", tmp.Name()}, strings.Fields(os.Getenv("DIRPV_NFS_HELPER_BUILDFLAGS"))...)
	cmd := exec.CommandContext(ctx, goTool(), append(args, HelperPackage)...)
	// Build from this package's source dir so it works whatever the caller's
	// working directory (tests of other packages run in their own dirs).
	if _, file, _, ok := runtime.Caller(0); ok {
		if st, err := os.Stat(filepath.Dir(file)); err == nil && st.IsDir() {
			cmd.Dir = filepath.Dir(file)
		}
	}
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("nfs: go build %s: %w\n%s", HelperPackage, err, b)
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return "", fmt.Errorf("nfs: installing mount helper: %w", err)
	}
	builtPath = out
	return out, nil
}

func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "bin", "go")
	}
	return "go"
}
