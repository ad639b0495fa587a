package framework

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"syscall"
)

// SnapshotTree describes every entry under root (names, types, modes, owners, file contents and
// symlink targets) without following symlinks, so that a test can show an attack changed
// nothing. skip leaves entries out by their path relative to root. Sockets and FIFOs are
// described, never opened.
func SnapshotTree(root string, skip func(rel string) bool) (map[string]string, error) {
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) && p != root {
				return nil // vanished between listing and visiting: shows up as removed
			}
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if skip != nil && skip(rel) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		desc := fi.Mode().String()
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			desc += fmt.Sprintf(" %d:%d", st.Uid, st.Gid)
		}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			desc += " -> " + target
		case fi.Mode().IsRegular():
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return err
			}
			desc += " " + hex.EncodeToString(h.Sum(nil))
		}
		out[rel] = desc
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", root, err)
	}
	return out, nil
}

// DiffSnapshots lists what was removed, added or changed between two snapshots, sorted.
func DiffSnapshots(before, after map[string]string) []string {
	var diffs []string
	for k, v := range before {
		if w, ok := after[k]; !ok {
			diffs = append(diffs, "removed "+k)
		} else if w != v {
			diffs = append(diffs, fmt.Sprintf("changed %s: %s -> %s", k, v, w))
		}
	}
	for k := range after {
		if _, ok := before[k]; !ok {
			diffs = append(diffs, "added "+k)
		}
	}
	sort.Strings(diffs)
	return diffs
}
