package vm

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/dirpv/dirpv/test/internal/filelock"
)

// Image is a Debian kernel and the initramfs that boots it with the host's root, cached under
// CacheDir()/<Version>.
type Image struct {
	// Version is the kernel release, e.g. "6.1.0-57-amd64".
	Version string
	// Dir is the cache directory of this version.
	Dir string
	// Kernel is the vmlinuz file.
	Kernel string
	// Initramfs is the gzipped newc cpio archive.
	Initramfs string
	// Modules is the kernel's module tree (lib/modules/<Version>, with modules.dep); the guest
	// links it into its /lib/modules so that modprobe works there.
	Modules string
}

// initramfsModules are loaded by the initramfs, each after its dependencies: what the boot
// needs (virtio, 9p, overlay) and what the tests use (NFS client and server, loop, XFS, ext4,
// quota). crc32c_generic comes first: libcrc32c (XFS) needs a crc32c implementation and only
// names it as a soft dependency. Others (btrfs) can be modprobe'd in the guest.
var initramfsModules = []string{
	"crc32c_generic",
	"virtio_pci", "9pnet_virtio", "9p", "overlay",
	"loop", "quota_tree", "quota_v2", "xfs", "ext4",
	"nfs", "nfsv3", "nfsv4", "nfsd",
}

// CacheDir is where kernels and initramfs images are kept, next to the Kubernetes build cache:
// ${DIRPV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dirpv}/vm.
func CacheDir() (string, error) {
	if d := os.Getenv("DIRPV_CACHE"); d != "" {
		return filepath.Join(d, "vm"), nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("vm: cache dir: %w", err)
	}
	return filepath.Join(d, "dirpv", "vm"), nil
}

// Prepare installs the host packages the VM needs and returns the image of the kernel that
// Debian's linux-image-amd64 names, downloading the kernel package and building the initramfs
// if they are not cached yet. Progress of a cold start goes to progress.
func Prepare(ctx context.Context, progress io.Writer) (*Image, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("vm: preparing the VM needs root (apt-get, and qemu's 9p export of /)")
	}
	if err := ensurePackages(ctx, progress, hostPackages); err != nil {
		return nil, fmt.Errorf("vm: host packages: %w", err)
	}
	version, err := kernelVersion(ctx)
	if err != nil {
		return nil, err
	}
	cache, err := CacheDir()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, fmt.Errorf("vm: creating cache: %w", err)
	}
	unlock, err := filelock.Lock(ctx, filepath.Join(cache, ".lock"), 100*time.Millisecond)
	if err != nil {
		return nil, err
	}
	defer unlock()
	img := imageAt(filepath.Join(cache, version), version)
	if _, err := os.Stat(img.Initramfs); err == nil {
		return img, nil
	}
	start := time.Now()
	fmt.Fprintf(progress, "dirpv-vm: preparing kernel %s in %s (cold start, about a minute)\n", version, img.Dir)
	// Built beside the final directory and renamed into place, so that an interrupted build
	// is never mistaken for a cached one.
	tmp, err := ownedTempDir(cache, version+".tmp-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	// apt-get download runs as the _apt user where it can, which must be able to enter tmp.
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	building := imageAt(tmp, version)
	if err := fetchKernel(ctx, progress, tmp, version); err != nil {
		return nil, err
	}
	fmt.Fprintln(progress, "dirpv-vm: building the initramfs")
	if err := buildInitramfs(ctx, building); err != nil {
		return nil, err
	}
	if err := os.RemoveAll(img.Dir); err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	if err := os.Rename(tmp, img.Dir); err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	fmt.Fprintf(progress, "dirpv-vm: kernel %s ready in %s\n", version, time.Since(start).Round(time.Second))
	return img, nil
}

func imageAt(dir, version string) *Image {
	return &Image{
		Version:   version,
		Dir:       dir,
		Kernel:    filepath.Join(dir, "root", "boot", "vmlinuz-"+version),
		Initramfs: filepath.Join(dir, "initramfs.gz"),
		Modules:   filepath.Join(dir, "root", "lib", "modules", version),
	}
}

var dependsRE = regexp.MustCompile(`(?m)^\s*Depends:\s*linux-image-(\d\S*-amd64)\s*$`)

// kernelVersion is the kernel release that linux-image-amd64 depends on. It follows Debian
// point releases, so it is resolved on every run; without package lists (a fresh machine)
// they are fetched first.
func kernelVersion(ctx context.Context) (string, error) {
	for attempt := 0; ; attempt++ {
		out, err := exec.CommandContext(ctx, "apt-cache", "depends", "linux-image-amd64").CombinedOutput()
		if m := dependsRE.FindSubmatch(out); err == nil && m != nil {
			return string(m[1]), nil
		}
		if attempt > 0 {
			return "", fmt.Errorf("vm: apt-cache depends linux-image-amd64 names no kernel (%v):\n%s", err, out)
		}
		if err := aptGet(ctx, "", "update"); err != nil {
			return "", fmt.Errorf("vm: %w", err)
		}
	}
}

// fetchKernel downloads linux-image-<version> into dir and extracts it to dir/root, without
// installing it on the host, then indexes its modules.
func fetchKernel(ctx context.Context, progress io.Writer, dir, version string) error {
	pkg := "linux-image-" + version
	fmt.Fprintf(progress, "dirpv-vm: apt-get download %s\n", pkg)
	if err := aptGet(ctx, dir, "download", pkg); err != nil {
		// The lists may predate the mirror's current point release.
		if uerr := aptGet(ctx, "", "update"); uerr != nil {
			return fmt.Errorf("vm: %w", errors.Join(err, uerr))
		}
		if err := aptGet(ctx, dir, "download", pkg); err != nil {
			return fmt.Errorf("vm: %w", err)
		}
	}
	debs, err := filepath.Glob(filepath.Join(dir, pkg+"_*.deb"))
	if err != nil || len(debs) != 1 {
		return fmt.Errorf("vm: want one %s .deb in %s, found %v (%v)", pkg, dir, debs, err)
	}
	fmt.Fprintf(progress, "dirpv-vm: extracting %s\n", filepath.Base(debs[0]))
	if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", debs[0], filepath.Join(dir, "root")).CombinedOutput(); err != nil {
		return fmt.Errorf("vm: dpkg-deb -x %s: %w\n%s", debs[0], err, out)
	}
	if err := os.Remove(debs[0]); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	if out, err := exec.CommandContext(ctx, "depmod", "-b", filepath.Join(dir, "root"), version).CombinedOutput(); err != nil {
		return fmt.Errorf("vm: depmod: %w\n%s", err, out)
	}
	return nil
}

// moduleOrder returns the module files (relative to the module tree) that load names, each
// after its own dependencies, from modules.dep. Names built into the kernel
// (modules.builtin) need no file.
func moduleOrder(modulesDir string, names []string) ([]string, error) {
	deps, err := readModulesDep(filepath.Join(modulesDir, "modules.dep"))
	if err != nil {
		return nil, err
	}
	builtin := map[string]bool{}
	if b, err := os.ReadFile(filepath.Join(modulesDir, "modules.builtin")); err == nil {
		for _, l := range strings.Fields(string(b)) {
			builtin[moduleName(l)] = true
		}
	}
	byName := map[string]string{}
	for file := range deps {
		byName[moduleName(file)] = file
	}
	var order []string
	seen := map[string]bool{}
	var visit func(file string)
	visit = func(file string) {
		if seen[file] {
			return
		}
		seen[file] = true
		for _, d := range deps[file] {
			visit(d)
		}
		order = append(order, file)
	}
	for _, n := range names {
		n = strings.ReplaceAll(n, "-", "_")
		file, ok := byName[n]
		switch {
		case ok:
			visit(file)
		case builtin[n]:
		default:
			return nil, fmt.Errorf("vm: module %s is neither in modules.dep nor built in", n)
		}
	}
	return order, nil
}

// moduleName is the kernel's name of a module file: "kernel/fs/9p/9p.ko.xz" is "9p", and
// dashes count as underscores.
func moduleName(file string) string {
	base := filepath.Base(file)
	if i := strings.Index(base, ".ko"); i >= 0 {
		base = base[:i]
	}
	return strings.ReplaceAll(base, "-", "_")
}

func readModulesDep(path string) (map[string][]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("vm: %w", err)
	}
	defer f.Close()
	deps := map[string][]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		file, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		deps[file] = strings.Fields(rest)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("vm: reading %s: %w", path, err)
	}
	return deps, nil
}

// buildInitramfs writes img.Initramfs: busybox, the modules of initramfsModules in load order
// and the /init of initScript, packed with busybox cpio (the host has no cpio binary).
func buildInitramfs(ctx context.Context, img *Image) error {
	order, err := moduleOrder(img.Modules, initramfsModules)
	if err != nil {
		return err
	}
	stage := filepath.Join(img.Dir, "initramfs")
	defer os.RemoveAll(stage)
	var files []string // archive members, parents first
	add := func(rel string, data []byte, mode os.FileMode) error {
		p := filepath.Join(stage, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		files = append(files, rel)
		return os.WriteFile(p, data, mode)
	}
	busybox, err := os.ReadFile("/bin/busybox")
	if err != nil {
		return fmt.Errorf("vm: busybox-static: %w", err)
	}
	files = append(files, "bin", "modules")
	if err := add("bin/busybox", busybox, 0o755); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	var names []string
	for _, file := range order {
		data, err := os.ReadFile(filepath.Join(img.Modules, file))
		if err != nil {
			return fmt.Errorf("vm: %w", err)
		}
		if strings.HasSuffix(file, ".xz") { // busybox insmod cannot read compressed modules
			out, err := exec.CommandContext(ctx, "xz", "-dc", filepath.Join(img.Modules, file)).Output()
			if err != nil {
				return fmt.Errorf("vm: unpacking %s: %w", file, err)
			}
			data = out
		}
		name := moduleName(file) + ".ko"
		names = append(names, name)
		if err := add("modules/"+name, data, 0o644); err != nil {
			return fmt.Errorf("vm: %w", err)
		}
	}
	if err := add("modules/order", []byte(strings.Join(names, "\n")+"\n"), 0o644); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	if err := add("init", []byte(initScript), 0o755); err != nil {
		return fmt.Errorf("vm: %w", err)
	}

	out, err := os.Create(img.Initramfs)
	if err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	defer out.Close()
	zw := gzip.NewWriter(out)
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "/bin/busybox", "cpio", "-o", "-H", "newc")
	cmd.Dir = stage
	cmd.Stdin = strings.NewReader(strings.Join(files, "\n") + "\n")
	cmd.Stdout, cmd.Stderr = zw, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("vm: busybox cpio: %w\n%s", err, stderr.Bytes())
	}
	if err := zw.Close(); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("vm: %w", err)
	}
	return nil
}
