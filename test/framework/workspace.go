package framework

import (
	"fmt"
	"os"
	"path/filepath"
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
