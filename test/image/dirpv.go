package image

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
)

// validTag is the OCI distribution spec's grammar of a tag.
var validTag = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)

// DirpvRepository is the image name deploy/ refers to.
const DirpvRepository = "ghcr.io/dirpv/dirpv"

// DirpvBinaryPath is where the Dockerfile, and so WriteDirpvTar, put the binary.
const DirpvBinaryPath = "/usr/local/bin/dirpv"

// DirpvOptions says how WriteDirpvTar builds the dirpv image.
type DirpvOptions struct {
	// ModuleDir is the dirpv module's root (holding go.mod); empty means the one `go env GOMOD`
	// finds from the current directory.
	ModuleDir string
	// Tag of ghcr.io/dirpv/dirpv; empty means Version, so that every build of another commit
	// gets another name (never "latest": a node that has an image under a name keeps running it).
	Tag string
	// Version is linked into the binary as internal/daemon.Version; empty means
	// `git describe --tags --always --dirty` in ModuleDir, or "dev" without git.
	Version string
	// Binary, when set, is a prebuilt static dirpv used instead of building one.
	Binary string
	// Output is the tar's path; empty means <ModuleDir>/bin/dirpv-image.tar.
	Output string
	// HostTools are host programs copied into the image with the shared libraries they load;
	// nil means DefaultHostTools.
	HostTools []HostTool
}

// HostTool is a host program to carry into the image. Every one is required: an image without
// one of them would start and then fail its first mount.
type HostTool struct {
	// Path on the host, which is also its path in the image (symlinks on the way, such as a
	// merged /usr's /bin -> usr/bin, are reproduced as symlinks).
	Path string
	// Package is the Debian package that installs Path, named when the host lacks it.
	Package string
	// Aliases are extra names in the same directory that are symlinks to Path (as Debian
	// ships mount.nfs4 -> mount.nfs).
	Aliases []string
}

// DefaultHostTools mirror the Dockerfile's runtime packages: mount/umount, which dirpv runs for
// every bind mount, and mount.nfs, which mount(8) runs (as /sbin/mount.<type>) for every NFS
// mount of the controller and the node plugin.
var DefaultHostTools = []HostTool{
	{Path: "/bin/mount", Package: "mount"},
	{Path: "/bin/umount", Package: "mount"},
	{Path: "/sbin/mount.nfs", Package: "nfs-common", Aliases: []string{"mount.nfs4", "umount.nfs", "umount.nfs4"}},
}

// hostFile is a data file copied into the image as it is.
type hostFile struct{ path, pkg string }

// hostFiles: libtirpc reads /etc/netconfig to pick transports for mount.nfs's RPC calls, and
// getprotobyname(3) reads /etc/protocols to map them to protocol numbers: without either,
// every NFSv3 mount fails ("Protocol not supported"; TestNFSv3NolockReadOnlyOnGuestNode).
var hostFiles = []hostFile{{"/etc/netconfig", "libtirpc-common"}, {"/etc/protocols", "netbase"}}

// checkHost returns one error naming every host file the image needs and the host lacks, with
// the Debian packages that provide them, so that a host without nfs-common gets no image rather
// than one whose NFS mounts fail in the cluster. exists is os.Stat in WriteDirpvTar.
func checkHost(tools []HostTool, exists func(string) error) error {
	var missing, pkgs []string
	need := func(p, pkg string) error {
		err := exists(p)
		if err == nil {
			return nil
		}
		if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("dirpv image: host tool %s: %w", p, err)
		}
		missing = append(missing, p)
		if pkg != "" && !slices.Contains(pkgs, pkg) {
			pkgs = append(pkgs, pkg)
		}
		return nil
	}
	for _, t := range tools {
		if err := need(t.Path, t.Package); err != nil {
			return err
		}
	}
	for _, f := range hostFiles {
		if err := need(f.path, f.pkg); err != nil {
			return err
		}
	}
	if len(missing) == 0 {
		return nil
	}
	err := fmt.Sprintf("dirpv image: this host lacks %s, which the image copies from it "+
		"(without them dirpv's mounts fail in the cluster)", strings.Join(missing, ", "))
	if len(pkgs) > 0 {
		err += fmt.Sprintf(": install the Debian packages %s (apt-get install %s)", strings.Join(pkgs, ", "), strings.Join(pkgs, " "))
	}
	return errors.New(err)
}

// WriteDirpvTar builds the dirpv binary with the Dockerfile's flags and writes an OCI image tar
// of ghcr.io/dirpv/dirpv:<tag> whose content mirrors the Dockerfile's runtime stage: the static
// binary at /usr/local/bin/dirpv plus the host's mount tools with their shared libraries and
// dynamic loader. It returns the tar's path and the image name. The result is imported with
// `ctr -n k8s.io images import` (or `kind load image-archive`), no engine or registry needed.
func WriteDirpvTar(ctx context.Context, opts DirpvOptions) (tarPath, imageName string, err error) {
	// WriteOCITar writes a linux/amd64 image, and the mount tools come from this host.
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		return "", "", fmt.Errorf("dirpv image: host is %s/%s, the image is linux/amd64 and borrows the host's mount tools", runtime.GOOS, runtime.GOARCH)
	}
	if opts.ModuleDir == "" {
		out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
		if err != nil {
			return "", "", fmt.Errorf("dirpv image: find module root: go env GOMOD: %w", err)
		}
		gomod := strings.TrimSpace(string(out))
		if gomod == "" || gomod == os.DevNull {
			return "", "", errors.New("dirpv image: not inside the dirpv module: set ModuleDir")
		}
		opts.ModuleDir = filepath.Dir(gomod)
	}
	if opts.Version == "" {
		opts.Version = gitVersion(ctx, opts.ModuleDir)
	}
	if opts.Tag == "" {
		opts.Tag = opts.Version
	}
	if !validTag.MatchString(opts.Tag) {
		return "", "", fmt.Errorf("dirpv image: %q is not a valid image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})", opts.Tag)
	}
	if opts.Tag == "latest" {
		return "", "", errors.New(`dirpv image: tag "latest" refused: deploy/ references versions, and a node keeps running whatever it has under a reused name`)
	}
	if opts.Output == "" {
		opts.Output = filepath.Join(opts.ModuleDir, "bin", "dirpv-image.tar")
	}
	if opts.HostTools == nil {
		opts.HostTools = DefaultHostTools
	}
	if err := checkHost(opts.HostTools, func(p string) error { _, err := os.Stat(p); return err }); err != nil {
		return "", "", err
	}
	imageName = DirpvRepository + ":" + opts.Tag
	if err := os.MkdirAll(filepath.Dir(opts.Output), 0o755); err != nil {
		return "", "", fmt.Errorf("dirpv image: %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(opts.Output), ".dirpv-image-")
	if err != nil {
		return "", "", fmt.Errorf("dirpv image: %w", err)
	}
	defer os.RemoveAll(tmp)

	bin := opts.Binary
	if bin == "" {
		bin = filepath.Join(tmp, "dirpv")
		if err := buildDirpv(ctx, opts.ModuleDir, opts.Version, bin); err != nil {
			return "", "", err
		}
	}
	files := []File{
		{HostPath: bin, ImagePath: DirpvBinaryPath, Mode: 0o755},
		{ImagePath: "/tmp", Dir: true, Mode: 0o777 | os.ModeSticky},
		// As in Debian: mount(8) and mount.nfs consult the kernel's table, never a file.
		{ImagePath: "/etc/mtab", Symlink: "../proc/self/mounts"},
	}
	c := newCollector()
	for _, t := range opts.HostTools {
		if err := c.addBinary(ctx, t.Path); err != nil {
			return "", "", fmt.Errorf("dirpv image: %w", err)
		}
		for _, a := range t.Aliases {
			alias := path.Join(path.Dir(t.Path), a)
			if err := c.addSymlink(alias, path.Base(t.Path)); err != nil {
				return "", "", fmt.Errorf("dirpv image: %w", err)
			}
		}
	}
	for _, f := range hostFiles {
		if err := c.addPath(f.path); err != nil {
			return "", "", fmt.Errorf("dirpv image: %w", err)
		}
	}
	files = append(files, c.files()...)
	cfg := Config{
		Entrypoint: []string{DirpvBinaryPath},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "dirpv",
			"org.opencontainers.image.version": opts.Version,
			"org.opencontainers.image.source":  "https://github.com/dirpv/dirpv",
		},
	}
	if err := WriteOCITar(opts.Output, imageName, files, cfg); err != nil {
		return "", "", err
	}
	return opts.Output, imageName, nil
}

// DirpvLDFlags are the linker flags of the Dockerfile and the Makefile's build target.
func DirpvLDFlags(version string) string {
	return "-s -w -X github.com/dirpv/dirpv/internal/daemon.Version=" + version
}

// DirpvTags are the build tags of the Dockerfile and the Makefile's build target. grpcnotrace
// leaves out gRPC's golang.org/x/net/trace, whose html/template (text/template's reflective
// method calls) makes the linker keep every exported method of every type it keeps: without
// it the binary has 27 MiB of code instead of 16, and a process has 8 MiB more of it resident
// from startup on. dirpv never enables gRPC's tracing, nor serves http.DefaultServeMux where
// it would show.
const DirpvTags = "grpcnotrace"

// DirpvBuildArgs are the arguments of `go build` for the binary that ships, before -o.
func DirpvBuildArgs(version string) []string {
	return []string{"build", "-trimpath", "-tags", DirpvTags, "-ldflags", DirpvLDFlags(version)}
}

func buildDirpv(ctx context.Context, moduleDir, version, out string) error {
	cmd := exec.CommandContext(ctx, "go", append(DirpvBuildArgs(version), "-o", out, "./cmd/dirpv")...)
	cmd.Dir = moduleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("dirpv image: go build ./cmd/dirpv: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

func gitVersion(ctx context.Context, dir string) string {
	cmd := exec.CommandContext(ctx, "git", "describe", "--tags", "--always", "--dirty")
	cmd.Dir = dir
	out, err := cmd.Output()
	if v := strings.TrimSpace(string(out)); err == nil && v != "" {
		return v
	}
	return "dev"
}

// collector gathers host files at their host paths. Symlinks met on the way (a merged /usr's
// /lib64 -> usr/lib64, libfoo.so.1 -> libfoo.so.1.2.3) become the same symlinks in the image,
// so the dynamic loader and mount(8) find everything where they would on the host.
type collector struct {
	entries map[string]File
	order   []string
}

func newCollector() *collector { return &collector{entries: map[string]File{}} }

func (c *collector) add(f File) {
	if _, ok := c.entries[f.ImagePath]; !ok {
		c.order = append(c.order, f.ImagePath)
	}
	c.entries[f.ImagePath] = f
}

func (c *collector) files() []File {
	out := make([]File, 0, len(c.order))
	for _, p := range c.order {
		out = append(out, c.entries[p])
	}
	return out
}

// addSymlink adds link -> target, resolving the directories of link the way addPath does.
func (c *collector) addSymlink(link, target string) error {
	dir, err := c.resolveDir(path.Dir(link), 0)
	if err != nil {
		return err
	}
	c.add(File{ImagePath: path.Join(dir, path.Base(link)), Symlink: target})
	return nil
}

// addBinary adds a dynamically linked (or static) program with every library ldd lists for it.
func (c *collector) addBinary(ctx context.Context, bin string) error {
	if err := c.addPath(bin); err != nil {
		return err
	}
	libs, err := lddPaths(ctx, bin)
	if err != nil {
		return err
	}
	for _, l := range libs {
		if err := c.addPath(l); err != nil {
			return err
		}
	}
	return nil
}

// addPath adds the host file p at the same path in the image, reproducing every symlink on
// the way (including p itself being one).
func (c *collector) addPath(p string) error {
	_, err := c.resolve(p, 0)
	return err
}

const maxSymlinks = 40

// resolve walks p one component at a time like the kernel does, adding each symlink it meets
// and finally the regular file, and returns p's real path.
func (c *collector) resolve(p string, depth int) (string, error) {
	if depth > maxSymlinks {
		return "", fmt.Errorf("%s: too many levels of symbolic links", p)
	}
	dir, err := c.resolveDir(path.Dir(path.Clean(p)), depth)
	if err != nil {
		return "", err
	}
	full := path.Join(dir, path.Base(p))
	st, err := os.Lstat(full)
	if err != nil {
		return "", err
	}
	switch {
	case st.Mode()&os.ModeSymlink != 0:
		target, err := os.Readlink(full)
		if err != nil {
			return "", err
		}
		c.add(File{ImagePath: full, Symlink: target})
		if !path.IsAbs(target) {
			target = path.Join(dir, target)
		}
		return c.resolve(target, depth+1)
	case st.Mode().IsRegular():
		c.add(File{HostPath: full, ImagePath: full})
		return full, nil
	default:
		return "", fmt.Errorf("%s: not a regular file or symlink", full)
	}
}

// resolveDir returns the real path of directory d, adding the symlinks among its components.
func (c *collector) resolveDir(d string, depth int) (string, error) {
	real := "/"
	for _, comp := range strings.Split(strings.TrimPrefix(path.Clean(d), "/"), "/") {
		if comp == "" {
			continue
		}
		next := path.Join(real, comp)
		st, err := os.Lstat(next)
		if err != nil {
			return "", err
		}
		if st.Mode()&os.ModeSymlink == 0 {
			real = next
			continue
		}
		if depth > maxSymlinks {
			return "", fmt.Errorf("%s: too many levels of symbolic links", d)
		}
		target, err := os.Readlink(next)
		if err != nil {
			return "", err
		}
		c.add(File{ImagePath: next, Symlink: target})
		if !path.IsAbs(target) {
			target = path.Join(real, target)
		}
		if real, err = c.resolveDir(target, depth+1); err != nil {
			return "", err
		}
	}
	return real, nil
}

// lddPaths returns the absolute paths of the shared libraries and the dynamic loader that ldd
// lists for bin (none for a static binary). A library ldd cannot find is an error: the program
// would not start in the image either.
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
