package release

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/dirpv/dirpv/test/deploy"
)

// TestRelease builds a release as make release does and checks it as a user receiving it
// would: the image index has both platforms, every program and library of each platform's
// image is built for that platform and finds its libraries there, the manifests name the
// image by the index's digest, the chart is versioned after the release, SHA256SUMS verifies.
func TestRelease(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds dirpv for two architectures")
	}
	const version = "v0.0.0-releasetest"
	rel, err := BuildLocal(t.Context(), filepath.Join(t.TempDir(), "dist"), version, DefaultImageRoots())
	if err != nil {
		t.Fatal(err) // make test-unit runs image-debs-<arch> and deploy-tools first
	}

	t.Run("SHA256SUMS", func(t *testing.T) {
		cmd := exec.CommandContext(t.Context(), "sha256sum", "--check", "--strict", SumsFile)
		cmd.Dir = rel.Dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("sha256sum --check: %v\n%s", err, out)
		}
		// ... and lists every other file of the release.
		b, err := os.ReadFile(filepath.Join(rel.Dir, SumsFile))
		if err != nil {
			t.Fatal(err)
		}
		var listed []string
		for line := range strings.Lines(string(b)) {
			_, name, _ := strings.Cut(strings.TrimSpace(line), "  ")
			listed = append(listed, name)
		}
		entries, err := os.ReadDir(rel.Dir)
		if err != nil {
			t.Fatal(err)
		}
		var files []string
		for _, e := range entries {
			if e.Name() != SumsFile {
				files = append(files, e.Name())
			}
		}
		want := []string{rel.Chart, ImageFile, KindManifest, NFSManifest}
		slices.Sort(want)
		if !slices.Equal(files, want) || !slices.Equal(listed, want) {
			t.Errorf("release holds %v, SHA256SUMS lists %v, want %v", files, listed, want)
		}
	})

	idx := readIndex(t, filepath.Join(rel.Dir, ImageFile))
	t.Run("index", func(t *testing.T) {
		if idx.name != "ghcr.io/dirpv/dirpv:"+version {
			t.Errorf("image name %q", idx.name)
		}
		var platforms []string
		for arch := range idx.variants {
			platforms = append(platforms, "linux/"+arch)
		}
		slices.Sort(platforms)
		if !slices.Equal(platforms, []string{"linux/amd64", "linux/arm64"}) {
			t.Errorf("index platforms %v, want linux/amd64 and linux/arm64", platforms)
		}
		if rel.ImageRef != "ghcr.io/dirpv/dirpv@"+idx.digest {
			t.Errorf("release names %s, the tar's index is %s", rel.ImageRef, idx.digest)
		}
	})

	for arch, v := range idx.variants {
		t.Run(arch, func(t *testing.T) {
			if v.config.Architecture != arch || v.config.OS != "linux" {
				t.Errorf("config says %s/%s", v.config.OS, v.config.Architecture)
			}
			if v.config.Config.Labels["org.opencontainers.image.version"] != version {
				t.Errorf("labels %v", v.config.Config.Labels)
			}
			machine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[arch]
			triplet := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[arch]
			libDirs := []string{"/lib/" + triplet, "/usr/lib/" + triplet, "/lib", "/usr/lib"}
			elfs := map[string]*elf.File{}
			for name, h := range v.layer.Hdr {
				data := v.layer.Data[name]
				if h.Typeflag != tar.TypeReg || !bytes.HasPrefix(data, []byte(elf.ELFMAG)) {
					continue
				}
				f, err := elf.NewFile(bytes.NewReader(data))
				if err != nil {
					t.Errorf("%s: %v", name, err)
					continue
				}
				if f.Machine != machine {
					t.Errorf("/%s is %s, want %s", name, f.Machine, machine)
				}
				elfs[name] = f
			}
			// The programs dirpv runs are among them (so that the checks cannot pass on an
			// image that lacks them).
			for _, p := range []string{"/usr/local/bin/dirpv", "/bin/mount", "/bin/umount", "/sbin/mount.nfs", "/sbin/mount.nfs4"} {
				if real := v.layer.resolve(p); elfs[real] == nil {
					t.Errorf("%s (-> /%s) is not an ELF file of the image", p, real)
				}
			}
			// Every library each of them loads is in the image, where the dynamic loader
			// (itself in the image) looks.
			for name, f := range elfs {
				for _, prog := range f.Progs {
					if prog.Type != elf.PT_INTERP {
						continue
					}
					b, _ := io.ReadAll(prog.Open())
					interp := strings.TrimRight(string(b), "\x00")
					if elfs[v.layer.resolve(interp)] == nil {
						t.Errorf("/%s: its loader %s is not in the image", name, interp)
					}
				}
				needed, err := f.DynString(elf.DT_NEEDED)
				if err != nil {
					t.Errorf("/%s: %v", name, err)
				}
				for _, lib := range needed {
					if !slices.ContainsFunc(libDirs, func(d string) bool { return elfs[v.layer.resolve(path.Join(d, lib))] != nil }) {
						t.Errorf("/%s needs %s, which is in none of %v", name, lib, libDirs)
					}
				}
			}
			for _, p := range []string{"/etc/netconfig", "/etc/protocols"} {
				if real := v.layer.resolve(p); v.layer.Hdr[real] == nil || v.layer.Hdr[real].Typeflag != tar.TypeReg {
					t.Errorf("%s is not a file of the image", p)
				}
			}
			if want := rel.Image.Manifests[arch].String(); v.digest != want {
				t.Errorf("manifest %s, Build reported %s", v.digest, want)
			}
			if arch == runtime.GOARCH && os.Geteuid() == 0 {
				if out := v.layer.runTools(t)["/usr/local/bin/dirpv"]; strings.TrimSpace(out) != version {
					t.Errorf("dirpv version %q, want %s", out, version)
				}
			}
		})
	}

	t.Run("manifests", func(t *testing.T) {
		for file, class := range map[string]string{KindManifest: "dirpv-local", NFSManifest: "dirpv-nfs"} {
			data, err := os.ReadFile(filepath.Join(rel.Dir, file))
			if err != nil {
				t.Fatal(err)
			}
			objs, err := deploy.Decode(data)
			if err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			var images []string
			var classes []string
			for _, o := range objs {
				if o.GetKind() == "StorageClass" {
					classes = append(classes, o.GetName())
				}
				for _, field := range []string{"containers", "initContainers"} {
					cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", field)
					for _, c := range cs {
						m, _ := c.(map[string]any)
						img, _, _ := unstructured.NestedString(m, "image")
						images = append(images, img)
					}
				}
			}
			if len(images) < 2 || slices.ContainsFunc(images, func(i string) bool { return i != rel.ImageRef }) {
				t.Errorf("%s: images %v, want every one %s", file, images, rel.ImageRef)
			}
			if !slices.Equal(classes, []string{class}) {
				t.Errorf("%s: StorageClasses %v, want %s", file, classes, class)
			}
		}
	})

	t.Run("chart", func(t *testing.T) {
		// helm show chart loads the package as helm install would and prints its Chart.yaml.
		helm, err := deploy.Tool(t.Context(), "helm", true)
		if err != nil {
			t.Fatal(err)
		}
		out, err := deploy.Helm(t.Context(), helm, "show", "chart", filepath.Join(rel.Dir, rel.Chart))
		if err != nil {
			t.Fatal(err)
		}
		if chart := "\n" + string(out); !strings.Contains(chart, "\nversion: 0.0.0-releasetest\n") || !strings.Contains(chart, "\nappVersion: "+version+"\n") {
			t.Errorf("%s's Chart.yaml:\n%s", rel.Chart, chart)
		}
	})
}

func TestChartVersion(t *testing.T) {
	for version, want := range map[string]string{
		"v0.2.0":                   "0.2.0",
		"v0.2.0-rc.1":              "0.2.0-rc.1",
		"v0.2.0-3-gabc1234-dirty":  "0.2.0-3-gabc1234-dirty",
		"a036484":                  "0.0.0-dev-a036484",
		"a036484-dirty":            "0.0.0-dev-a036484-dirty",
		"v1.02.0":                  "0.0.0-dev-v1-02-0",
		"release/2026_12+whatever": "0.0.0-dev-release-2026-12-whatever",
	} {
		if got := ChartVersion(version); got != want {
			t.Errorf("ChartVersion(%q) = %q, want %q", version, got, want)
		}
	}
}

// index is an OCI layout tar's one image index, read with nothing but the OCI spec.
type index struct {
	name, digest string
	variants     map[string]variant
}

type variant struct {
	digest string
	config struct {
		Architecture, OS string
		Config           struct{ Labels map[string]string }
	}
	layer imageLayer
}

func readIndex(t *testing.T, tarPath string) index {
	t.Helper()
	files := readLayout(t, tarPath)
	type descriptor struct {
		MediaType   string
		Digest      string
		Annotations map[string]string
		Platform    *struct{ Architecture, OS string }
	}
	blob := func(digest string) []byte { return files.blob(t, digest) }
	var layout struct{ Manifests []descriptor }
	if err := json.Unmarshal(files["index.json"], &layout); err != nil || len(layout.Manifests) != 1 ||
		layout.Manifests[0].MediaType != "application/vnd.oci.image.index.v1+json" {
		t.Fatalf("index.json: want one image index: %v %s", err, files["index.json"])
	}
	idx := index{name: layout.Manifests[0].Annotations["io.containerd.image.name"], digest: layout.Manifests[0].Digest, variants: map[string]variant{}}
	var imageIndex struct{ Manifests []descriptor }
	if err := json.Unmarshal(blob(idx.digest), &imageIndex); err != nil {
		t.Fatal(err)
	}
	for _, m := range imageIndex.Manifests {
		if m.Platform == nil || m.Platform.OS != "linux" {
			t.Fatalf("index entry without a linux platform: %+v", m)
		}
		var manifest struct {
			Config struct{ Digest string }
			Layers []struct{ Digest string }
		}
		if err := json.Unmarshal(blob(m.Digest), &manifest); err != nil || len(manifest.Layers) != 1 {
			t.Fatalf("manifest %s: %v %+v", m.Digest, err, manifest)
		}
		v := variant{digest: m.Digest, layer: readLayer(t, blob(manifest.Layers[0].Digest))}
		if err := json.Unmarshal(blob(manifest.Config.Digest), &v.config); err != nil {
			t.Fatal(err)
		}
		if _, dup := idx.variants[m.Platform.Architecture]; dup {
			t.Fatalf("two images for linux/%s", m.Platform.Architecture)
		}
		idx.variants[m.Platform.Architecture] = v
	}
	return idx
}

// ociLayout is an OCI layout tar's files: index.json and the blobs.
type ociLayout map[string][]byte

// readLayout reads the OCI layout tar at tarPath.
func readLayout(t testing.TB, tarPath string) ociLayout {
	t.Helper()
	f, err := os.Open(tarPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := ociLayout{}
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

// blob returns the content of digest, checking that it is what its digest says.
func (l ociLayout) blob(t testing.TB, digest string) []byte {
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

// imageLayer is an image's layer: headers and contents by path without the leading /.
type imageLayer struct {
	Hdr  map[string]*tar.Header
	Data map[string][]byte
}

// readLayer reads the layer blob b, gzipped or not.
func readLayer(t testing.TB, b []byte) imageLayer {
	t.Helper()
	var r io.Reader = bytes.NewReader(b)
	if len(b) > 2 && b[0] == 0x1f && b[1] == 0x8b {
		gz, err := gzip.NewReader(bufio.NewReader(r))
		if err != nil {
			t.Fatal(err)
		}
		r = gz
	}
	l := imageLayer{Hdr: map[string]*tar.Header{}, Data: map[string][]byte{}}
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

// resolve follows symlinks inside the layer as the container's kernel would and returns the
// path without its leading /, or "" when a component is missing (or the links loop).
func (l imageLayer) resolve(p string) string {
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

// runTools unpacks the layer and runs dirpv and the mount tools in it with chroot, as the
// container does, and returns what each printed by its argv[0] (a failure is the test's).
func (l imageLayer) runTools(t testing.TB) map[string]string {
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
