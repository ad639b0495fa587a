package image

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
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
	// Binary, when set, is a prebuilt static linux/amd64 dirpv used instead of building one
	// for hostPlatform (other platforms' are always built).
	Binary string
	// Output is the tar's path; empty means <ModuleDir>/bin/dirpv-image.tar.
	Output string
}

// HostTool is a host program to carry into the image. Every one is required: an image without
// one of them would start and then fail its first mount.
type HostTool struct {
	// Path beneath the platform's Root (the host's own for hostPlatform), which is also its
	// path in the image (symlinks on the way, such as a merged /usr's /bin -> usr/bin, are
	// reproduced as symlinks).
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

// Platform is an architecture the dirpv image is built for.
type Platform struct {
	// Arch is the GOARCH dirpv is cross-compiled for ("amd64", "arm64"); every ELF file of the
	// variant must be of it.
	Arch string
	// Root is the file tree the variant's mount tools, their shared libraries and hostFiles
	// are taken from, at their usual paths beneath it: "/" (this host) for the host's own
	// architecture, or the architecture's Debian packages unpacked (make image-debs-arm64).
	Root string
}

// hostPlatform is linux/amd64 with the mount tools of this host: what WriteDirpvTar builds.
var hostPlatform = Platform{Arch: "amd64", Root: "/"}

// WriteDirpvTar builds the dirpv binary with the Dockerfile's flags and writes an OCI image tar
// of ghcr.io/dirpv/dirpv:<tag> whose content mirrors the Dockerfile's runtime stage: the static
// binary at /usr/local/bin/dirpv plus the host's mount tools with their shared libraries and
// dynamic loader. It returns the tar's path and the image name. The result is imported with
// `ctr -n k8s.io images import` (or `kind load image-archive`), no engine or registry needed.
func WriteDirpvTar(ctx context.Context, opts DirpvOptions) (tarPath, imageName string, err error) {
	if err := opts.complete(ctx); err != nil {
		return "", "", err
	}
	imageName = DirpvRepository + ":" + opts.Tag
	tmp, err := os.MkdirTemp(filepath.Dir(opts.Output), ".dirpv-image-")
	if err != nil {
		return "", "", fmt.Errorf("dirpv image: %w", err)
	}
	defer os.RemoveAll(tmp)
	files, err := dirpvFiles(ctx, opts, hostPlatform, tmp)
	if err != nil {
		return "", "", err
	}
	if err := WriteOCITar(opts.Output, imageName, files, dirpvConfig(opts.Version)); err != nil {
		return "", "", err
	}
	return opts.Output, imageName, nil
}

// DirpvIndex is a multi-platform dirpv image that WriteDirpvIndex wrote.
type DirpvIndex struct {
	// Tar is the OCI layout tar, Name the image's name (ghcr.io/dirpv/dirpv:<tag>).
	Tar, Name string
	// Digest is the index's: ghcr.io/dirpv/dirpv@<Digest> names the image on every platform.
	Digest v1.Hash
	// Manifests are the digests of each platform's image by Arch.
	Manifests map[string]v1.Hash
}

// WriteDirpvIndex is WriteDirpvTar for several platforms at once: an OCI layout tar holding an
// image index with one image per platform, each with dirpv built for its Arch and the mount
// tools of its Root. opts.Binary, when set, is used for the host platform only.
func WriteDirpvIndex(ctx context.Context, opts DirpvOptions, platforms []Platform) (*DirpvIndex, error) {
	if err := opts.complete(ctx); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(filepath.Dir(opts.Output), ".dirpv-image-")
	if err != nil {
		return nil, fmt.Errorf("dirpv image: %w", err)
	}
	defer os.RemoveAll(tmp)
	var variants []Variant
	for _, p := range platforms {
		dir := filepath.Join(tmp, p.Arch)
		if err := os.Mkdir(dir, 0o755); err != nil {
			return nil, fmt.Errorf("dirpv image: %w", err)
		}
		files, err := dirpvFiles(ctx, opts, p, dir)
		if err != nil {
			return nil, err
		}
		variants = append(variants, Variant{Arch: p.Arch, Files: files, Config: dirpvConfig(opts.Version)})
	}
	name := DirpvRepository + ":" + opts.Tag
	digest, manifests, err := WriteOCIIndexTar(opts.Output, name, variants)
	if err != nil {
		return nil, err
	}
	return &DirpvIndex{Tar: opts.Output, Name: name, Digest: digest, Manifests: manifests}, nil
}

// complete fills in opts' defaults and checks them.
func (opts *DirpvOptions) complete(ctx context.Context) error {
	if runtime.GOOS != "linux" {
		return fmt.Errorf("dirpv image: host is %s, the image borrows a linux host's mount tools", runtime.GOOS)
	}
	if opts.ModuleDir == "" {
		out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
		if err != nil {
			return fmt.Errorf("dirpv image: find module root: go env GOMOD: %w", err)
		}
		gomod := strings.TrimSpace(string(out))
		if gomod == "" || gomod == os.DevNull {
			return errors.New("dirpv image: not inside the dirpv module: set ModuleDir")
		}
		opts.ModuleDir = filepath.Dir(gomod)
	}
	if opts.Version == "" {
		opts.Version = GitVersion(ctx, opts.ModuleDir)
	}
	if opts.Tag == "" {
		opts.Tag = opts.Version
	}
	if !validTag.MatchString(opts.Tag) {
		return fmt.Errorf("dirpv image: %q is not a valid image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})", opts.Tag)
	}
	if opts.Tag == "latest" {
		return errors.New(`dirpv image: tag "latest" refused: deploy/ references versions, and a node keeps running whatever it has under a reused name`)
	}
	if opts.Output == "" {
		opts.Output = filepath.Join(opts.ModuleDir, "bin", "dirpv-image.tar")
	}
	if err := os.MkdirAll(filepath.Dir(opts.Output), 0o755); err != nil {
		return fmt.Errorf("dirpv image: %w", err)
	}
	return nil
}

// dirpvFiles returns the files of platform p's image: dirpv built for p.Arch into tmp (or
// opts.Binary on the host platform), and the mount tools with their libraries and data files
// from p.Root.
func dirpvFiles(ctx context.Context, opts DirpvOptions, p Platform, tmp string) ([]File, error) {
	root := filepath.Clean(p.Root)
	exists := func(f string) error { _, err := os.Stat(filepath.Join(root, f)); return err }
	if err := checkHost(DefaultHostTools, exists); err != nil {
		if root != "/" {
			return nil, fmt.Errorf("linux/%s tree %s is incomplete (make image-debs-%s unpacks it): %w", p.Arch, root, p.Arch, err)
		}
		return nil, err
	}
	bin := opts.Binary
	if bin == "" || p != hostPlatform {
		bin = filepath.Join(tmp, "dirpv")
		if err := buildDirpv(ctx, opts.ModuleDir, opts.Version, p.Arch, bin); err != nil {
			return nil, err
		}
	}
	files := []File{
		{HostPath: bin, ImagePath: DirpvBinaryPath, Mode: 0o755},
		{ImagePath: "/tmp", Dir: true, Mode: 0o777 | os.ModeSticky},
		// As in Debian: mount(8) and mount.nfs consult the kernel's table, never a file.
		{ImagePath: "/etc/mtab", Symlink: "../proc/self/mounts"},
	}
	c, err := newCollector(root, p.Arch)
	if err != nil {
		return nil, fmt.Errorf("dirpv image: %w", err)
	}
	for _, t := range DefaultHostTools {
		if err := c.addBinary(t.Path); err != nil {
			return nil, fmt.Errorf("dirpv image: linux/%s: %w", p.Arch, err)
		}
		for _, a := range t.Aliases {
			alias := path.Join(path.Dir(t.Path), a)
			if err := c.addSymlink(alias, path.Base(t.Path)); err != nil {
				return nil, fmt.Errorf("dirpv image: %w", err)
			}
		}
	}
	for _, f := range hostFiles {
		if err := c.addPath(f.path); err != nil {
			return nil, fmt.Errorf("dirpv image: %w", err)
		}
	}
	return append(files, c.files()...), nil
}

func dirpvConfig(version string) Config {
	return Config{
		Entrypoint: []string{DirpvBinaryPath},
		Labels: map[string]string{
			"org.opencontainers.image.title":   "dirpv",
			"org.opencontainers.image.version": version,
			"org.opencontainers.image.source":  "https://github.com/dirpv/dirpv",
		},
	}
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

func buildDirpv(ctx context.Context, moduleDir, version, arch, out string) error {
	cmd := exec.CommandContext(ctx, "go", append(DirpvBuildArgs(version), "-o", out, "./cmd/dirpv")...)
	cmd.Dir = moduleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("dirpv image: GOARCH=%s go build ./cmd/dirpv: %w: %s", arch, err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

// GitVersion is the version of the checkout in dir as make names it: `git describe --tags
// --always --dirty`, or "dev" without git.
func GitVersion(ctx context.Context, dir string) string {
	cmd := exec.CommandContext(ctx, "git", "describe", "--tags", "--always", "--dirty")
	cmd.Dir = dir
	out, err := cmd.Output()
	if v := strings.TrimSpace(string(out)); err == nil && v != "" {
		return v
	}
	return "dev"
}

// ELF machines and Debian multiarch triplets by GOARCH.
var (
	elfMachine = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	multiarch  = map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}
)

// LibraryDirs are the directories where a Debian system's dynamic loader finds the shared
// libraries of arch (its ld.so.conf and default paths, in order).
func LibraryDirs(arch string) []string {
	t := multiarch[arch]
	return []string{"/lib/" + t, "/usr/lib/" + t, "/lib", "/usr/lib"}
}

// collector gathers files of a tree (root) at their paths beneath it. Symlinks met on the way
// (a merged /usr's /lib64 -> usr/lib64, libfoo.so.1 -> libfoo.so.1.2.3) become the same
// symlinks in the image, so the dynamic loader and mount(8) find everything where they would
// on a system installed from that tree.
type collector struct {
	root    string
	arch    string
	machine elf.Machine
	entries map[string]File
	order   []string
	elfDone map[string]bool
}

func newCollector(root, arch string) (*collector, error) {
	m, ok := elfMachine[arch]
	if !ok {
		return nil, fmt.Errorf("architecture %q: not one of amd64, arm64", arch)
	}
	return &collector{root: root, arch: arch, machine: m, entries: map[string]File{}, elfDone: map[string]bool{}}, nil
}

// host returns the path of image path p in the tree.
func (c *collector) host(p string) string { return filepath.Join(c.root, p) }

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

// addBinary adds a dynamically linked (or static) program with its dynamic loader and every
// library it loads, found as the loader would: each DT_NEEDED in LibraryDirs, transitively.
// Read from the ELF files rather than asked of ldd, which runs the loader and so only works
// for the host's own architecture. A file of another architecture, or a library that is not
// there, is an error: the program would not start in the image either.
func (c *collector) addBinary(p string) error {
	real, err := c.resolve(p, 0)
	if err != nil {
		return err
	}
	if c.elfDone[real] {
		return nil
	}
	c.elfDone[real] = true
	f, err := elf.Open(c.host(real))
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	defer f.Close()
	if f.Machine != c.machine {
		return fmt.Errorf("%s is %s, not %s (%s)", p, f.Machine, c.machine, c.arch)
	}
	for _, prog := range f.Progs {
		if prog.Type != elf.PT_INTERP {
			continue
		}
		b, err := io.ReadAll(prog.Open())
		if err != nil {
			return fmt.Errorf("%s: interpreter: %w", p, err)
		}
		if err := c.addBinary(strings.TrimRight(string(b), "\x00")); err != nil {
			return fmt.Errorf("%s: interpreter: %w", p, err)
		}
	}
	needed, err := f.DynString(elf.DT_NEEDED)
	if err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	for _, lib := range needed {
		found := ""
		for _, d := range LibraryDirs(c.arch) {
			if _, err := os.Stat(c.host(path.Join(d, lib))); err == nil {
				found = path.Join(d, lib)
				break
			}
		}
		if found == "" {
			return fmt.Errorf("%s needs %s, which is in none of %s beneath %s", p, lib, strings.Join(LibraryDirs(c.arch), ", "), c.root)
		}
		if err := c.addBinary(found); err != nil {
			return err
		}
	}
	return nil
}

// addPath adds the file p of the tree at the same path in the image, reproducing every
// symlink on the way (including p itself being one).
func (c *collector) addPath(p string) error {
	_, err := c.resolve(p, 0)
	return err
}

const maxSymlinks = 40

// resolve walks p one component at a time like the kernel does, adding each symlink it meets
// and finally the regular file, and returns p's real path. Absolute symlinks stay in the tree.
func (c *collector) resolve(p string, depth int) (string, error) {
	if depth > maxSymlinks {
		return "", fmt.Errorf("%s: too many levels of symbolic links", p)
	}
	dir, err := c.resolveDir(path.Dir(path.Clean(p)), depth)
	if err != nil {
		return "", err
	}
	full := path.Join(dir, path.Base(p))
	st, err := os.Lstat(c.host(full))
	if err != nil {
		return "", err
	}
	switch {
	case st.Mode()&os.ModeSymlink != 0:
		target, err := os.Readlink(c.host(full))
		if err != nil {
			return "", err
		}
		c.add(File{ImagePath: full, Symlink: target})
		if !path.IsAbs(target) {
			target = path.Join(dir, target)
		}
		return c.resolve(target, depth+1)
	case st.Mode().IsRegular():
		c.add(File{HostPath: c.host(full), ImagePath: full})
		return full, nil
	default:
		return "", fmt.Errorf("%s: not a regular file or symlink", c.host(full))
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
		st, err := os.Lstat(c.host(next))
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
		target, err := os.Readlink(c.host(next))
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
