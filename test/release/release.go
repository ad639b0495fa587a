// Package release builds dirpv's release artifacts without a Docker engine or a registry
// (make release): the image as a multi-platform OCI index (linux/amd64 and linux/arm64),
// single-file manifests rendered from deploy/'s overlays with that image pinned by digest, the
// packaged Helm chart, and SHA256SUMS of them all.
package release

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/image"
)

// The files of a release directory besides the chart, whose name helm package gives it
// (dirpv-<chart version>.tgz).
const (
	// ImageFile is the OCI layout tar of the image index, named ghcr.io/dirpv/dirpv:<version>.
	ImageFile = "dirpv-image.oci.tar"
	// KindManifest is deploy/overlays/kind rendered: dirpv with the default class dirpv-local.
	KindManifest = "dirpv-kind.yaml"
	// NFSManifest is deploy/overlays/nfs rendered: dirpv with the class dirpv-nfs, whose
	// export (nfs-export.yaml's placeholder) a user sets before applying it.
	NFSManifest = "dirpv-nfs.yaml"
	// SumsFile lists the SHA-256 of every other file, as sha256sum writes them.
	SumsFile = "SHA256SUMS"
)

// Options say what Build builds, and where.
type Options struct {
	// ModuleDir is the dirpv checkout (holding go.mod).
	ModuleDir string
	// Version is linked into dirpv, tags the image and versions the chart: a release tag such
	// as v0.2.0, or any `git describe` output between them.
	Version string
	// Dir receives the release. An existing Dir is replaced only if it holds a release (a
	// SHA256SUMS) or nothing, so that a mistyped -o removes no one's files.
	Dir string
	// ImageRoots holds, in <arch>/root, Debian's packages of each architecture unpacked (make
	// image-debs-<arch>), which that architecture's image takes its mount tools and their
	// libraries from.
	ImageRoots string
	// Kustomize and Helm are the pinned tools' paths (test/deploy/tools.sh).
	Kustomize, Helm string
}

// Release is what Build wrote.
type Release struct {
	Dir     string
	Version string
	Image   *image.DirpvIndex
	// ImageRef is ghcr.io/dirpv/dirpv@<index digest>, which the manifests name.
	ImageRef string
	// Chart is the packaged chart's file name in Dir.
	Chart string
}

// DefaultImageRoots is where make image-debs-<arch> unpacks Debian's packages of each
// architecture, in <arch>/root (the Makefile's IMAGE_ROOTS).
func DefaultImageRoots() string {
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".cache", "dirpv", "image-debs")
}

// BuildLocal is Build of this checkout with the pinned kustomize and helm (built when
// missing): what make release runs, and the tests that check or install a release.
func BuildLocal(ctx context.Context, dir, version, imageRoots string) (*Release, error) {
	opts := Options{Dir: dir, Version: version, ImageRoots: imageRoots}
	var err error
	if opts.ModuleDir, err = deploy.RepoDir(); err != nil {
		return nil, err
	}
	if opts.Kustomize, err = deploy.Tool(ctx, "kustomize", true); err != nil {
		return nil, err
	}
	if opts.Helm, err = deploy.Tool(ctx, "helm", true); err != nil {
		return nil, err
	}
	return Build(ctx, opts)
}

// Arches are the release's image platforms' architectures (linux/<arch>).
var Arches = []string{"amd64", "arm64"}

// Platforms are the release's image platforms, each with its tree of Debian packages in
// imageRoots; a missing tree is an error naming the make target that unpacks it.
func Platforms(imageRoots string) ([]image.Platform, error) {
	var ps []image.Platform
	for _, arch := range Arches {
		root := filepath.Join(imageRoots, arch, "root")
		if _, err := os.Stat(root); err != nil {
			return nil, fmt.Errorf("release: the %s packages (make image-debs-%s unpacks them): %w", arch, arch, err)
		}
		ps = append(ps, image.Platform{Arch: arch, Root: root})
	}
	return ps, nil
}

// Build writes the release into opts.Dir, all of it or nothing: the files are made in a
// directory beside it, which then takes its place.
func Build(ctx context.Context, opts Options) (*Release, error) {
	if opts.Version == "" || opts.Dir == "" || opts.ModuleDir == "" || opts.ImageRoots == "" || opts.Kustomize == "" || opts.Helm == "" {
		return nil, fmt.Errorf("release: incomplete options %+v", opts)
	}
	chartVersion := ChartVersion(opts.Version)
	dir := filepath.Clean(opts.Dir)
	if err := replaceable(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), "."+filepath.Base(dir)+"-")
	if err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	defer os.RemoveAll(tmp)

	platforms, err := Platforms(opts.ImageRoots)
	if err != nil {
		return nil, err
	}
	idx, err := image.WriteDirpvIndex(ctx, image.DirpvOptions{ModuleDir: opts.ModuleDir, Version: opts.Version,
		Output: filepath.Join(tmp, ImageFile)}, platforms)
	if err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	rel := &Release{Dir: dir, Version: opts.Version, Image: idx, ImageRef: image.DirpvRepository + "@" + idx.Digest.String(),
		Chart: "dirpv-" + chartVersion + ".tgz"}
	for overlay, file := range map[string]string{"kind": KindManifest, "nfs": NFSManifest} {
		out, err := deploy.RenderOverlay(ctx, opts.Kustomize, overlay, rel.ImageRef)
		if err != nil {
			return nil, fmt.Errorf("release: %w", err)
		}
		head := fmt.Sprintf("# dirpv %s: deploy/overlays/%s, image %s (linux/amd64, linux/arm64).\n", opts.Version, overlay, rel.ImageRef)
		if err := os.WriteFile(filepath.Join(tmp, file), append([]byte(head), out...), 0o644); err != nil {
			return nil, fmt.Errorf("release: %w", err)
		}
	}
	// The chart names the image by tag (its appVersion), the tag the release's image is
	// pushed under: its values have no digest.
	if _, err := deploy.Helm(ctx, opts.Helm, "package", filepath.Join(opts.ModuleDir, "deploy", "helm", "dirpv"),
		"--version", chartVersion, "--app-version", opts.Version, "--destination", tmp); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	if _, err := os.Stat(filepath.Join(tmp, rel.Chart)); err != nil {
		return nil, fmt.Errorf("release: helm package: %w", err)
	}
	if err := writeSums(tmp); err != nil {
		return nil, err
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	rel.Image.Tar = filepath.Join(dir, ImageFile)
	return rel, nil
}

// replaceable refuses a dir that exists and holds files but no release.
func replaceable(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) || (err == nil && len(entries) == 0) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	if _, err := os.Stat(filepath.Join(dir, SumsFile)); err != nil {
		return fmt.Errorf("release: %s holds files but no %s: not replacing it", dir, SumsFile)
	}
	return nil
}

// semver is SemVer 2.0's grammar, with the v of a Git tag allowed in front.
var semver = regexp.MustCompile(`^v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$`)

// ChartVersion is the chart's version for a release version: the tag without its v (v0.2.0 ->
// 0.2.0, and `git describe`'s v0.2.0-3-gabc1234 -> 0.2.0-3-gabc1234, a pre-release of it), or
// for a version that is no SemVer (a bare commit) 0.0.0-dev-<version>, which orders before
// every release.
func ChartVersion(version string) string {
	if semver.MatchString(version) {
		return strings.TrimPrefix(version, "v")
	}
	return "0.0.0-dev-" + regexp.MustCompile(`[^0-9A-Za-z-]`).ReplaceAllString(version, "-")
}

// writeSums writes SumsFile in dir for every other file there, as `sha256sum *` would.
func writeSums(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	var lines []string
	for _, e := range entries {
		if e.Name() == SumsFile || !e.Type().IsRegular() {
			continue
		}
		sum, err := fileSHA256(filepath.Join(dir, e.Name()))
		if err != nil {
			return fmt.Errorf("release: %w", err)
		}
		lines = append(lines, sum+"  "+e.Name()+"\n")
	}
	if err := os.WriteFile(filepath.Join(dir, SumsFile), []byte(strings.Join(lines, "")), 0o644); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

func fileSHA256(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
