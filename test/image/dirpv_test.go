package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/dirpv/dirpv/test/image/imagetest"
)

// lddPaths returns the absolute paths of the shared libraries and the dynamic loader that ldd
// lists for bin (none for a static binary): what the image must hold for bin on this host,
// asked of the host's loader rather than of the ELF reading the image builder does.
func lddPaths(ctx context.Context, bin string) ([]string, error) {
	out, err := exec.CommandContext(ctx, "ldd", bin).CombinedOutput()
	if err != nil {
		// ldd exits 1 for static binaries ("not a dynamic executable").
		if strings.Contains(string(out), "not a dynamic executable") || strings.Contains(string(out), "statically linked") {
			return nil, nil
		}
		return nil, fmt.Errorf("ldd %s: %w: %s", bin, err, strings.TrimSpace(string(out)))
	}
	return parseLdd(string(out), bin)
}

// parseLdd reads lines such as
//
//	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)
//	/lib64/ld-linux-x86-64.so.2 (0x...)
//	linux-vdso.so.1 (0x...)
func parseLdd(out, bin string) ([]string, error) {
	var paths []string
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.Contains(line, "statically linked") {
			continue
		}
		name, found, hasArrow := strings.Cut(line, "=>")
		if hasArrow {
			found = strings.TrimSpace(found)
			if strings.HasPrefix(found, "not found") {
				return nil, fmt.Errorf("ldd %s: %s not found", bin, strings.TrimSpace(name))
			}
		} else {
			found = name
		}
		p, _, _ := strings.Cut(strings.TrimSpace(found), " ")
		if path.IsAbs(p) {
			paths = append(paths, p)
		}
		// Anything else (linux-vdso.so.1) is provided by the kernel.
	}
	return paths, sc.Err()
}

func TestParseLdd(t *testing.T) {
	out := `	linux-vdso.so.1 (0x00007ffd5b9f2000)
	libmount.so.1 => /lib/x86_64-linux-gnu/libmount.so.1 (0x00007f691e4ae000)
	libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f691e29e000)
	/lib64/ld-linux-x86-64.so.2 (0x00007f691e533000)
`
	got, err := parseLdd(out, "/bin/mount")
	must(t, err)
	want := []string{"/lib/x86_64-linux-gnu/libmount.so.1", "/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := parseLdd("\tlibfoo.so.1 => not found\n", "/bin/x"); err == nil || !strings.Contains(err.Error(), "libfoo.so.1") {
		t.Errorf("missing library: err %v", err)
	}
}

func readImage(t *testing.T, tarPath string) (annotations map[string]string, config map[string]any, l imagetest.Layer) {
	t.Helper()
	files := imagetest.ReadLayout(t, tarPath)
	var index struct {
		Manifests []struct {
			Digest      string            `json:"digest"`
			Annotations map[string]string `json:"annotations"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal(files["index.json"], &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("index.json: %v %s", err, files["index.json"])
	}
	var manifest struct {
		Config struct{ Digest string }
		Layers []struct{ Digest string }
	}
	if err := json.Unmarshal(files.Blob(t, index.Manifests[0].Digest), &manifest); err != nil || len(manifest.Layers) != 1 {
		t.Fatalf("manifest: %v %+v", err, manifest)
	}
	must(t, json.Unmarshal(files.Blob(t, manifest.Config.Digest), &config))
	return index.Manifests[0].Annotations, config, imagetest.ReadLayer(t, files.Blob(t, manifest.Layers[0].Digest))
}

// TestWriteDirpvTar builds the real image: the binary with the Dockerfile's flags, the host's
// mount tools with every library they load, and the name containerd imports it under. As root
// it also runs the tools from the unpacked layer in a chroot, which is what the node plugin
// does in its container.
func TestWriteDirpvTar(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds dirpv")
	}
	if _, err := exec.LookPath("ldd"); err != nil {
		t.Skip("no ldd on this host")
	}
	const version = "v0.0.0-imagetest"
	out := filepath.Join(t.TempDir(), "dirpv.tar")
	// No Tag: the image is named after the version, as `make image-tar` names it.
	got, name, err := WriteDirpvTar(t.Context(), DirpvOptions{Version: version, Output: out})
	if err != nil {
		t.Fatal(err) // on a host without nfs-common, the error says so; make test-unit installs it
	}
	if got != out || name != "ghcr.io/dirpv/dirpv:"+version {
		t.Errorf("WriteDirpvTar = %s, %s", got, name)
	}
	annotations, config, l := readImage(t, out)
	resolve := func(p string) string {
		r := l.Resolve(p)
		if r == "" {
			t.Errorf("image lacks %s", p)
		}
		return r
	}
	if annotations["io.containerd.image.name"] != "ghcr.io/dirpv/dirpv:"+version {
		t.Errorf("annotations %v", annotations)
	}
	cfg, _ := config["config"].(map[string]any)
	if ep, _ := json.Marshal(cfg["Entrypoint"]); string(ep) != `["/usr/local/bin/dirpv"]` {
		t.Errorf("entrypoint %s", ep)
	}
	if labels, _ := cfg["Labels"].(map[string]any); labels["org.opencontainers.image.version"] != version {
		t.Errorf("labels %v", cfg["Labels"])
	}

	if h := l.Hdr["usr/local/bin/dirpv"]; h == nil || h.Mode&0o111 == 0 {
		t.Fatalf("no executable usr/local/bin/dirpv: %+v", h)
	}
	for _, f := range []string{"/etc/netconfig", "/etc/protocols"} {
		if real := resolve(f); real != "" && l.Hdr[real].Typeflag != tar.TypeReg {
			t.Errorf("%s -> %s is not a file", f, real)
		}
	}
	for _, tool := range []string{"/bin/mount", "/bin/umount", "/sbin/mount.nfs", "/sbin/mount.nfs4", "/sbin/umount.nfs"} {
		real := resolve(tool)
		if real == "" {
			continue
		}
		if h := l.Hdr[real]; h.Typeflag != tar.TypeReg || h.Mode&0o111 == 0 {
			t.Errorf("%s -> %s: not an executable file", tool, real)
		}
		libs, err := lddPaths(t.Context(), tool)
		must(t, err)
		if len(libs) == 0 {
			continue // a static build of the tool
		}
		for _, lib := range libs {
			if r := resolve(lib); r != "" && l.Hdr[r].Typeflag != tar.TypeReg {
				t.Errorf("%s: %s -> %s is not a file", tool, lib, r)
			}
		}
	}

	if os.Geteuid() != 0 {
		t.Log("not root: skipping the chroot run")
		return
	}
	if out := l.RunTools(t)["/usr/local/bin/dirpv"]; strings.TrimSpace(out) != version {
		t.Errorf("dirpv version %q, want %s (ldflags)", out, version)
	}
}

// TestCheckHostNamesMissingPackages: a host without nfs-common (or util-linux's mount) gets an
// error naming each missing file and the package to install, never an image without them.
func TestCheckHostNamesMissingPackages(t *testing.T) {
	lacking := func(missing ...string) func(string) error {
		return func(p string) error {
			if slices.Contains(missing, p) {
				return &os.PathError{Op: "stat", Path: p, Err: syscall.ENOENT}
			}
			return nil
		}
	}
	if err := checkHost(DefaultHostTools, lacking()); err != nil {
		t.Errorf("nothing missing: %v", err)
	}
	cases := map[string]struct {
		missing []string
		want    []string
	}{
		"no nfs-common": {[]string{"/sbin/mount.nfs"}, []string{"/sbin/mount.nfs", "install the Debian packages nfs-common ", "apt-get install nfs-common)"}},
		"no mount":      {[]string{"/bin/mount", "/bin/umount"}, []string{"/bin/mount, /bin/umount", "apt-get install mount)"}},
		"both":          {[]string{"/bin/umount", "/sbin/mount.nfs"}, []string{"/bin/umount, /sbin/mount.nfs", "apt-get install mount nfs-common)"}},
		"no netconfig":  {[]string{"/etc/netconfig"}, []string{"/etc/netconfig", "apt-get install libtirpc-common)"}},
		"no protocols":  {[]string{"/etc/protocols"}, []string{"/etc/protocols", "apt-get install netbase)"}},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			err := checkHost(DefaultHostTools, lacking(tc.missing...))
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
	// Any other failure is reported as it is, not as a package to install.
	err := checkHost(DefaultHostTools, func(p string) error {
		return &os.PathError{Op: "stat", Path: p, Err: syscall.EACCES}
	})
	if !errors.Is(err, syscall.EACCES) || strings.Contains(err.Error(), "apt-get") {
		t.Errorf("EACCES: %v", err)
	}
}

// TestWriteDirpvTarRefuses: a missing host tool or a reusable tag stops WriteDirpvTar before it
// builds anything, and no tar is left behind.
func TestWriteDirpvTarRefuses(t *testing.T) {
	dir := t.TempDir()
	// Never built: each case fails before the binary would be used.
	bin := filepath.Join(dir, "no-such-dirpv")
	missing := filepath.Join(dir, "sbin", "mount.nfs")
	cases := map[string]struct {
		opts DirpvOptions
		want string
	}{
		"missing tool": {DirpvOptions{Tag: "t", HostTools: []HostTool{{Path: missing, Package: "nfs-common"}}}, missing + ", which the image copies"},
		"latest":       {DirpvOptions{Tag: "latest"}, `tag "latest" refused`},
		"bad tag":      {DirpvOptions{Tag: "v1/evil"}, "not a valid image tag"},
		"bad version":  {DirpvOptions{Version: "1.0+build"}, "not a valid image tag"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			out := filepath.Join(dir, name+".tar")
			tc.opts.Output, tc.opts.Binary, tc.opts.ModuleDir = out, bin, dir
			if tc.opts.Version == "" {
				tc.opts.Version = "v1"
			}
			_, _, err := WriteDirpvTar(t.Context(), tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %v, want one containing %q", err, tc.want)
			}
			if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s: %v, want no tar", out, err)
			}
		})
	}
}

// The shipped binary keeps the linker's dead-code elimination of methods: nothing in it calls
// reflect's Method or MethodByName with a name unknown at link time (text/template does, and
// gRPC's tracing brought it in until DirpvTags left that out). One such call anywhere makes the
// linker keep every exported method of every type it keeps, 11 MiB more code.
func TestDirpvKeepsMethodDeadCodeElimination(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: links dirpv")
	}
	args := DirpvBuildArgs("v0.0.0-dcetest")
	i := slices.Index(args, "-ldflags")
	if i < 0 {
		t.Fatalf("no -ldflags in %v", args)
	}
	// -dumpdep prints the linker's reachability graph, marking each function that calls
	// reflect's method lookups by name.
	args[i+1] += " -dumpdep"
	cmd := exec.CommandContext(t.Context(), "go", append(args, "-o", filepath.Join(t.TempDir(), "dirpv"), "./cmd/dirpv")...)
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	var graph bytes.Buffer
	cmd.Stderr = &graph
	if err := cmd.Run(); err != nil {
		t.Fatalf("go %v: %v\n%s", args, err, graph.String()[:min(graph.Len(), 4000)])
	}
	var marked []string
	for _, line := range strings.Split(graph.String(), "\n") {
		if from, _, ok := strings.Cut(line, " -> "); ok && strings.HasSuffix(from, " <ReflectMethod>") {
			if f := strings.TrimSuffix(from, " <ReflectMethod>"); !slices.Contains(marked, f) {
				marked = append(marked, f)
			}
		}
	}
	if len(marked) > 0 {
		t.Errorf("reachable functions call reflect's Method/MethodByName, so the linker keeps every exported method: %v", marked)
	}
}
