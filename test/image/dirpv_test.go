package image

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

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
