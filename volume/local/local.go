// Package local keeps the base directories of local classes open on a node, and makes sure
// each is still the file system its volumes are on before anything is created or removed
// beneath it (volume.BaseRecords).
package local

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/dirpv/dirpv/volume"
)

// ErrUnusable marks a local base path that could not be created or opened on this node.
var ErrUnusable = errors.New("base path unusable")

// Bases keeps the base directories of local classes open, and makes sure each is still the
// file system its volumes are on (volume.BaseRecords). The zero value is ready to use.
type Bases struct {
	// Records are the bases' identities (role node; nil: unchecked, for tests of other parts).
	Records *volume.BaseRecords

	mu     sync.Mutex
	byBase map[string]*volume.Root
	// retired are roots replaced because their path moved (Moved); other calls may still be
	// using them, so they are closed with the rest.
	retired []*volume.Root
}

// Do runs fn on the root of basePath, which is allowed or beneath allowed. The allowed base
// is the admin's (set by flag) and may be reached through symlinks; basePath is opened beneath
// it without following any, and both are created on first use. A root whose path has moved
// since (an admin mounted the disk meant for the base after the class was first used, say) is
// opened again, so that volumes go where the path leads now. A base that held volumes is
// never created, and must still be the file system it was (volume.ErrBaseChanged otherwise).
func (l *Bases) Do(allowed, basePath string, fn func(*volume.Root) error) error {
	l.mu.Lock()
	root, ok := l.byBase[basePath]
	if ok {
		if moved, err := root.Moved(); err != nil || moved {
			l.retired = append(l.retired, root)
			delete(l.byBase, basePath)
			ok = false
		}
	}
	if !ok {
		held := false
		if l.Records != nil {
			var err error
			if held, err = l.Records.Held(basePath); err != nil {
				l.mu.Unlock()
				return fmt.Errorf("%w: %w", ErrUnusable, err)
			}
		}
		var err error
		if root, err = OpenBase(allowed, basePath, !held); err != nil {
			l.mu.Unlock()
			if held && errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("base path %s is %w: it held volumes but is gone (%w); the disk meant to be mounted at or above it "+
					"is probably not mounted. dirpv creates and deletes no volume there until it is back, and carries on by itself then. "+
					"If the base was removed on purpose, remove %s on this node",
					basePath, volume.ErrBaseChanged, err, l.Records.RecordPath(basePath))
			}
			return fmt.Errorf("%w: %w", ErrUnusable, err)
		}
		if l.byBase == nil {
			l.byBase = map[string]*volume.Root{}
		}
		l.byBase[basePath] = root
	}
	l.mu.Unlock()
	if l.Records != nil {
		if err := l.Records.Check(basePath, root); err != nil {
			if errors.Is(err, volume.ErrBaseChanged) {
				return err
			}
			return fmt.Errorf("%w: %w", ErrUnusable, err)
		}
	}
	return fn(root)
}

// Held records that basePath holds a volume, so that it must keep its identity from now on.
func (l *Bases) Held(basePath string) error {
	if l.Records == nil {
		return nil
	}
	return l.Records.MarkHeld(basePath)
}

// OpenBase opens basePath beneath allowed without following symlinks, making both first with
// create.
func OpenBase(allowed, basePath string, create bool) (*volume.Root, error) {
	if create {
		if err := os.MkdirAll(allowed, 0o755); err != nil {
			return nil, fmt.Errorf("create allowed base path: %w", err)
		}
	}
	top, err := volume.OpenRoot(allowed)
	if err != nil {
		return nil, err
	}
	defer top.Close()
	rel, err := filepath.Rel(allowed, basePath)
	if err != nil {
		return nil, fmt.Errorf("base path %s beneath %s: %w", basePath, allowed, err)
	}
	if rel == "." {
		rel = ""
	}
	root, err := top.OpenSubRoot(rel, create)
	if err != nil {
		return nil, fmt.Errorf("open base path: %w", err)
	}
	return root, nil
}

// Close closes every base, for shutdown.
func (l *Bases) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for base, root := range l.byBase {
		root.Close()
		delete(l.byBase, base)
	}
	for _, root := range l.retired {
		root.Close()
	}
	l.retired = nil
}
