// Package imagetest reads the OCI layout tars that test/image writes, with nothing but the OCI
// spec, for the tests of the image (test/image) and of the release (test/release).
package imagetest

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"testing"
)

// Layout is an OCI layout tar's files: index.json and the blobs.
type Layout map[string][]byte

// ReadLayout reads the OCI layout tar at tarPath.
func ReadLayout(t testing.TB, tarPath string) Layout {
	t.Helper()
	f, err := os.Open(tarPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := Layout{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		if files[h.Name], err = io.ReadAll(tr); err != nil {
			t.Fatal(err)
		}
	}
}

// Blob returns the content of digest, checking that it is what its digest says.
func (l Layout) Blob(t testing.TB, digest string) []byte {
	t.Helper()
	b, ok := l["blobs/"+strings.Replace(digest, ":", "/", 1)]
	if !ok {
		t.Fatalf("no blob %s", digest)
	}
	if sum := sha256.Sum256(b); "sha256:"+hex.EncodeToString(sum[:]) != digest {
		t.Fatalf("blob %s has digest sha256:%x", digest, sum)
	}
	return b
}

// Layer is an image's layer: headers and contents by path without the leading /.
type Layer struct {
	Hdr  map[string]*tar.Header
	Data map[string][]byte
}

// ReadLayer reads the layer blob b, gzipped or not.
func ReadLayer(t testing.TB, b []byte) Layer {
	t.Helper()
	var r io.Reader = bytes.NewReader(b)
	if len(b) > 2 && b[0] == 0x1f && b[1] == 0x8b {
		gz, err := gzip.NewReader(bufio.NewReader(r))
		if err != nil {
			t.Fatal(err)
		}
		r = gz
	}
	l := Layer{Hdr: map[string]*tar.Header{}, Data: map[string][]byte{}}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return l
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		l.Hdr[h.Name], l.Data[h.Name] = h, b
	}
}

// Resolve follows symlinks inside the layer as the container's kernel would and returns the
// path without its leading /, or "" when a component is missing (or the links loop).
func (l Layer) Resolve(p string) string {
	cur := ""
	comps := strings.Split(strings.Trim(path.Clean(p), "/"), "/")
	for hops := 0; len(comps) > 0; {
		next := path.Join(cur, comps[0])
		comps = comps[1:]
		h := l.Hdr[next]
		if h == nil {
			h = l.Hdr[next+"/"]
		}
		if h == nil || hops > 40 {
			return ""
		}
		if h.Typeflag != tar.TypeSymlink {
			cur = next
			continue
		}
		hops++
		target := h.Linkname
		if !path.IsAbs(target) {
			target = path.Join("/", cur, target)
		}
		comps = append(strings.Split(strings.Trim(path.Clean(target), "/"), "/"), comps...)
		cur = ""
	}
	return cur
}

// RunTools unpacks the layer and runs dirpv and the mount tools in it with chroot, as the
// container does, and returns what each printed by its argv[0] (a failure is the test's).
func (l Layer) RunTools(t testing.TB) map[string]string {
	t.Helper()
	root := t.TempDir()
	for name, h := range l.Hdr {
		dst := filepath.Join(root, name)
		var err error
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(dst, 0o755)
		case tar.TypeSymlink:
			if err = os.MkdirAll(filepath.Dir(dst), 0o755); err == nil {
				err = os.Symlink(h.Linkname, dst)
			}
		case tar.TypeReg:
			if err = os.MkdirAll(filepath.Dir(dst), 0o755); err == nil {
				err = os.WriteFile(dst, l.Data[name], os.FileMode(h.Mode).Perm())
			}
		}
		if err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
	}
	out := map[string]string{}
	for _, argv := range [][]string{{"/usr/local/bin/dirpv", "version"}, {"/bin/mount", "--version"}, {"/bin/umount", "--version"}, {"/sbin/mount.nfs", "-V"}} {
		b, err := exec.Command("chroot", append([]string{root}, argv...)...).CombinedOutput()
		if err != nil {
			t.Errorf("chroot %s: %v: %s", strings.Join(argv, " "), err, b)
		}
		out[argv[0]] = string(b)
	}
	return out
}
