package framework

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// FillEmptyFiles creates n empty files under dir, a thousand to a subdirectory d0, d1, ...:
// a tree of many names made fast, as a tenant's volume looks to whoever must copy or remove it.
func FillEmptyFiles(dir string, n int) error {
	const perDir = 1000
	for d := 0; d*perDir < n; d++ {
		sub := filepath.Join(dir, "d"+strconv.Itoa(d))
		if err := os.Mkdir(sub, 0o755); err != nil {
			return err
		}
		fd, err := unix.Open(sub, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		for i := 0; i < perDir && d*perDir+i < n; i++ {
			f, err := unix.Openat(fd, strconv.Itoa(i), unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
			if err != nil {
				unix.Close(fd)
				return fmt.Errorf("create %s/%d: %w", sub, i, err)
			}
			unix.Close(f)
		}
		unix.Close(fd)
	}
	return nil
}

// SnapshotTree describes every entry under root (names, types, modes, owners, file contents and
// symlink targets) without following symlinks, so that a test can show an attack changed
// nothing. skip leaves entries out by their path relative to root. Sockets and FIFOs are
// described, never opened.
func SnapshotTree(root string, skip func(rel string) bool) (map[string]string, error) {
	return describeTree(root, skip, false)
}

// TreeHash is SnapshotTree plus what a copy of the tree (a clone, a restored snapshot) must
// keep besides: sizes, modification times, extended attributes (dirpv's own, trusted.dirpv.*,
// left out) and hard-link groups (each name of a file with several names the walk meets after
// the first says which it is linked to). Access times are left out: describing a file reads
// it. Two trees are the same to a user if their TreeHash is (DiffSnapshots).
func TreeHash(root string) (map[string]string, error) {
	return describeTree(root, nil, true)
}

func describeTree(root string, skip func(rel string) bool, full bool) (map[string]string, error) {
	out := map[string]string{}
	firstName := map[uint64]string{}
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
		if full {
			more, err := describeMore(p, rel, fi, firstName)
			if err != nil {
				return err
			}
			desc += more
		}
		out[rel] = desc
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", root, err)
	}
	return out, nil
}

// describeMore is what TreeHash adds to SnapshotTree's description of p.
func describeMore(p, rel string, fi fs.FileInfo, firstName map[uint64]string) (string, error) {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return "", fmt.Errorf("%s: no stat", p)
	}
	desc := fmt.Sprintf(" size=%d mtime=%d.%09d", st.Size, st.Mtim.Sec, st.Mtim.Nsec)
	if fi.IsDir() {
		desc = fmt.Sprintf(" mtime=%d.%09d", st.Mtim.Sec, st.Mtim.Nsec) // a directory's size is the file system's
	} else if st.Nlink > 1 {
		if first, ok := firstName[st.Ino]; ok {
			desc += " linked-to=" + first
		} else {
			firstName[st.Ino] = rel
		}
	}
	names, err := xattr(func(b []byte) (int, error) { return unix.Llistxattr(p, b) })
	if err != nil {
		return "", fmt.Errorf("list extended attributes of %s: %w", p, err)
	}
	var attrs []string
	for _, name := range strings.Split(strings.TrimSuffix(string(names), "\x00"), "\x00") {
		if name == "" || strings.HasPrefix(name, "trusted.dirpv.") {
			continue
		}
		val, err := xattr(func(b []byte) (int, error) { return unix.Lgetxattr(p, name, b) })
		if err != nil {
			return "", fmt.Errorf("read extended attribute %s of %s: %w", name, p, err)
		}
		attrs = append(attrs, fmt.Sprintf("%s=%q", name, val))
	}
	sort.Strings(attrs)
	return desc + " xattrs[" + strings.Join(attrs, " ") + "]", nil
}

// xattr calls read with a buffer as big as it needs.
func xattr(read func([]byte) (int, error)) ([]byte, error) {
	for {
		n, err := read(nil)
		if err != nil || n == 0 {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = read(buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew meanwhile
		}
		return buf[:n], err
	}
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
