// Package image builds small container images from host files without a Docker engine or a
// registry. The result is an OCI image layout packed into a tar, annotated with
// io.containerd.image.name so that `ctr -n k8s.io images import` registers it under that name
// and kubelet can run it with imagePullPolicy: Never.
package image

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// File is one entry of the image's single layer.
type File struct {
	// HostPath is the file copied into the image. Ignored when Symlink is set.
	HostPath string
	// ImagePath is the absolute path inside the image, e.g. /bin/busybox.
	ImagePath string
	// Mode is the permission bits in the image; 0 keeps the host file's mode (0755 for
	// directories and symlinks).
	Mode os.FileMode
	// Symlink, when set, makes ImagePath a symlink pointing at this target instead of a copy.
	Symlink string
	// Dir, when set, makes ImagePath an (empty) directory.
	Dir bool
}

// Config is the part of the OCI image config that our images need.
type Config struct {
	Entrypoint []string
	Cmd        []string
	Env        []string
	User       string
	Labels     map[string]string
}

// fixedTime keeps layer digests reproducible: the same inputs give the same image ID.
var fixedTime = time.Unix(0, 0).UTC()

// WriteOCITar writes a single-layer linux/amd64 image built from files to path as an OCI layout
// tar. imageName should be fully qualified (e.g. "dirpv.local/busybox:1.35") because containerd's
// CRI looks images up by their normalised reference.
func WriteOCITar(tarPath, imageName string, files []File, cfg Config) error {
	img, err := buildImage("amd64", files, cfg)
	if err != nil {
		return fmt.Errorf("image %s: %w", imageName, err)
	}
	return writeLayout(tarPath, imageName, func(lp layout.Path, opts ...layout.Option) error {
		return lp.AppendImage(img, append(opts, layout.WithPlatform(v1.Platform{OS: "linux", Architecture: "amd64"}))...)
	})
}

// Variant is one platform's image of a multi-platform index.
type Variant struct {
	// Arch is the GOARCH of the variant's binaries ("amd64", "arm64"); the OS is linux.
	Arch   string
	Files  []File
	Config Config
}

// WriteOCIIndexTar writes an OCI layout tar whose one entry is an image index of variants, one
// single-layer image per platform, named imageName as WriteOCITar names its image. It returns
// the index's digest, which names the whole multi-platform image in a registry
// (repository@digest), and each variant's manifest digest by Arch.
func WriteOCIIndexTar(tarPath, imageName string, variants []Variant) (index v1.Hash, manifests map[string]v1.Hash, err error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	manifests = map[string]v1.Hash{}
	for _, v := range variants {
		img, err := buildImage(v.Arch, v.Files, v.Config)
		if err != nil {
			return v1.Hash{}, nil, fmt.Errorf("image %s (%s): %w", imageName, v.Arch, err)
		}
		if manifests[v.Arch], err = img.Digest(); err != nil {
			return v1.Hash{}, nil, fmt.Errorf("image %s (%s): %w", imageName, v.Arch, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: v.Arch}}})
	}
	if index, err = idx.Digest(); err != nil {
		return v1.Hash{}, nil, fmt.Errorf("image %s: index: %w", imageName, err)
	}
	err = writeLayout(tarPath, imageName, func(lp layout.Path, opts ...layout.Option) error {
		return lp.AppendIndex(idx, opts...)
	})
	return index, manifests, err
}

// buildImage returns the single-layer linux/arch image of files with cfg.
func buildImage(arch string, files []File, cfg Config) (v1.Image, error) {
	layerBytes, err := layerTar(files)
	if err != nil {
		return nil, fmt.Errorf("build layer: %w", err)
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerBytes)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("append layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	cf = cf.DeepCopy()
	cf.Architecture = arch
	cf.OS = "linux"
	cf.Created = v1.Time{Time: fixedTime}
	cf.Config.Entrypoint = cfg.Entrypoint
	cf.Config.Cmd = cfg.Cmd
	cf.Config.Env = cfg.Env
	if len(cf.Config.Env) == 0 {
		cf.Config.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	}
	cf.Config.User = cfg.User
	cf.Config.Labels = cfg.Labels
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("set config: %w", err)
	}
	return img, nil
}

// writeLayout writes an OCI layout whose index.json has the one entry that add appends (with
// the layout options it is given, which name it imageName), packed into tarPath.
func writeLayout(tarPath, imageName string, add func(layout.Path, ...layout.Option) error) error {
	dir, err := os.MkdirTemp(filepath.Dir(tarPath), ".oci-layout-")
	if err != nil {
		return fmt.Errorf("image %s: temp layout dir: %w", imageName, err)
	}
	defer os.RemoveAll(dir)
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return fmt.Errorf("image %s: init layout: %w", imageName, err)
	}
	err = add(lp, layout.WithAnnotations(map[string]string{
		// containerd's importer names the image after this annotation; the OCI one is
		// kept for other tools (skopeo, crane) reading the same tar.
		"io.containerd.image.name":          imageName,
		"org.opencontainers.image.ref.name": refName(imageName),
	}))
	if err != nil {
		return fmt.Errorf("image %s: write layout: %w", imageName, err)
	}
	if err := tarDir(dir, tarPath); err != nil {
		return fmt.Errorf("image %s: pack %s: %w", imageName, tarPath, err)
	}
	return nil
}

// refName returns the tag part of name ("latest" when absent), which is what the OCI
// ref.name annotation conventionally holds.
func refName(name string) string {
	if i := strings.LastIndex(name, ":"); i > strings.LastIndex(name, "/") {
		return name[i+1:]
	}
	return "latest"
}

// layerTar returns the uncompressed layer: parent directories first, then entries in path order
// so that the output is deterministic.
func layerTar(files []File) ([]byte, error) {
	sorted := append([]File(nil), files...)
	sort.SliceStable(sorted, func(i, j int) bool { return sorted[i].ImagePath < sorted[j].ImagePath })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{"/": true}
	var addParents func(p string) error
	addParents = func(p string) error {
		d := path.Dir(p)
		if dirs[d] {
			return nil
		}
		if err := addParents(d); err != nil {
			return err
		}
		dirs[d] = true
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/",
			Mode: 0o755, ModTime: fixedTime, Format: tar.FormatPAX})
	}
	for _, f := range sorted {
		p := path.Clean(f.ImagePath)
		if !path.IsAbs(p) || p == "/" {
			return nil, fmt.Errorf("image path %q must be absolute and not /", f.ImagePath)
		}
		if err := addParents(p); err != nil {
			return nil, err
		}
		name := strings.TrimPrefix(p, "/")
		hdr := &tar.Header{Name: name, ModTime: fixedTime, Format: tar.FormatPAX, Mode: int64(f.Mode.Perm())}
		switch {
		case f.Symlink != "":
			hdr.Typeflag, hdr.Linkname = tar.TypeSymlink, f.Symlink
			if hdr.Mode == 0 {
				hdr.Mode = 0o777
			}
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, err
			}
		case f.Dir:
			if dirs[p] {
				continue
			}
			dirs[p] = true
			hdr.Typeflag, hdr.Name = tar.TypeDir, name+"/"
			if hdr.Mode == 0 {
				hdr.Mode = 0o755
			}
			if f.Mode&os.ModeSticky != 0 { // /tmp's
				hdr.Mode |= 0o1000
			}
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, err
			}
		default:
			data, err := os.ReadFile(f.HostPath)
			if err != nil {
				return nil, fmt.Errorf("read %s: %w", f.HostPath, err)
			}
			if hdr.Mode == 0 {
				st, err := os.Stat(f.HostPath)
				if err != nil {
					return nil, err
				}
				hdr.Mode = int64(st.Mode().Perm())
			}
			hdr.Typeflag, hdr.Size = tar.TypeReg, int64(len(data))
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, err
			}
			if _, err := tw.Write(data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// tarDir packs the layout directory (regular files and directories only) into dst atomically.
func tarDir(dir, dst string) error {
	tmp := dst + ".tmp"
	out, err := os.Create(tmp)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	tw := tar.NewWriter(out)
	err = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		hdr, err := tar.FileInfoHeader(info, "")
		if err != nil {
			return err
		}
		hdr.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			hdr.Name += "/"
		}
		hdr.ModTime, hdr.Uname, hdr.Gname, hdr.Uid, hdr.Gid = fixedTime, "", "", 0, 0
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		_, err = io.Copy(tw, f)
		return err
	})
	if err != nil {
		out.Close()
		return err
	}
	if err := tw.Close(); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, dst)
}
