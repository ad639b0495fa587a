package framework

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/dirpv/dirpv/test/nfs"
)

// Workspace is a test binary's scratch directory, with logs and local base paths in it. It is
// removed after a successful run and kept, with its path printed, after a failed one or when
// keep is set.
type Workspace struct {
	Dir      string
	LogDir   string
	BaseRoot string
	ok       bool
}

// NewWorkspace makes a workspace whose removal is registered with cleanups; it also detaches
// mounts a killed dirpv left under it.
func NewWorkspace(prefix string, cleanups *Cleanups, keep bool) (*Workspace, error) {
	dir, err := os.MkdirTemp("", prefix)
	if err != nil {
		return nil, fmt.Errorf("work dir: %w", err)
	}
	w := &Workspace{Dir: dir, LogDir: filepath.Join(dir, "logs"), BaseRoot: filepath.Join(dir, "bases")}
	for _, d := range []string{w.LogDir, w.BaseRoot} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	cleanups.Add(func() {
		// Detach first: RemoveAll would otherwise descend into what is still mounted here.
		DetachMountsUnder(dir)
		if !w.ok || keep {
			fmt.Fprintf(os.Stderr, "workspace and logs kept in %s\n", dir)
			return
		}
		os.RemoveAll(dir)
	})
	return w, nil
}

// Succeeded lets the workspace be removed at cleanup.
func (w *Workspace) Succeeded() { w.ok = true }

// StartNFS starts a real NFS server exporting a directory of the workspace (so that Kill and
// Resume keep it) and builds the test-only mount helper that dirpv is handed with
// --nfs-mount-helper on hosts without a kernel NFS client.
func StartNFS(ctx context.Context, w *Workspace, cleanups *Cleanups) (srv *nfs.Server, mountHelper string, err error) {
	if err := nfs.EnsurePackages(ctx); err != nil {
		return nil, "", err
	}
	if mountHelper, err = nfs.BuildMountHelper(ctx); err != nil {
		return nil, "", fmt.Errorf("build NFS mount helper: %w", err)
	}
	exportDir := filepath.Join(w.Dir, "export")
	if err := os.MkdirAll(exportDir, 0o777); err != nil {
		return nil, "", err
	}
	if srv, err = nfs.Start(ctx, nfs.Options{ExportDir: exportDir, WorkDir: filepath.Join(w.Dir, "ganesha")}); err != nil {
		return nil, "", fmt.Errorf("start NFS server: %w", err)
	}
	cleanups.Add(func() { srv.Stop() })
	return srv, mountHelper, nil
}
