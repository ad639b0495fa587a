package volume

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrBaseNotAllowed is returned when a local volume's directory is outside every base path the
// node allows, or inside (or around) kubelet's root directory.
var ErrBaseNotAllowed = errors.New("local volume refused")

// AllowedBases says where on a node local volumes may live: at or beneath one of the bases an
// admin allowed (the directories the node plugin's DaemonSet mounts), and never in or around
// kubelet's root directory, which holds every pod's volumes and projected secrets. A PV is
// written by whoever may create PVs, so its basePath is checked against this, not trusted.
type AllowedBases struct {
	bases []allowedBase // deepest first, so Locate picks the most specific base
	// kubeletRoots is kubelet's root dir, cleaned, and its symlink-resolved form if different.
	kubeletRoots []string
}

type allowedBase struct {
	path     string // clean, as given
	resolved string // with symlinks resolved, or path if it does not exist yet
}

// NewAllowedBases checks bases (absolute, other than /) and kubeletRoot (absolute) and refuses
// a base at or beneath kubelet's root dir, so a node plugin configured that way fails at
// startup instead of at its first mount. Bases that do not exist yet are allowed (the node's
// provisioner creates a class's base on first use).
func NewAllowedBases(bases []string, kubeletRoot string) (*AllowedBases, error) {
	if !filepath.IsAbs(kubeletRoot) {
		return nil, fmt.Errorf("kubelet root dir %q must be an absolute path", kubeletRoot)
	}
	a := &AllowedBases{kubeletRoots: withResolved(filepath.Clean(kubeletRoot))}
	for _, b := range bases {
		if !filepath.IsAbs(b) {
			return nil, fmt.Errorf("allowed base path %q must be an absolute path", b)
		}
		b = filepath.Clean(b)
		if b == "/" {
			return nil, fmt.Errorf("allowed base path / would allow every directory on the host")
		}
		forms := withResolved(b)
		for _, f := range forms {
			if kr, ok := a.kubeletRoot(f); ok {
				return nil, fmt.Errorf("allowed base path %s is at or beneath kubelet's root dir %s, which holds every pod's volumes and secrets", b, kr)
			}
		}
		a.bases = append(a.bases, allowedBase{path: b, resolved: forms[len(forms)-1]})
	}
	slices.SortStableFunc(a.bases, func(x, y allowedBase) int { return len(y.path) - len(x.path) })
	return a, nil
}

// withResolved returns p and, if it exists and differs, p with its symlinks resolved.
func withResolved(p string) []string {
	if r, err := filepath.EvalSymlinks(p); err == nil && r != p {
		return []string{p, r}
	}
	return []string{p}
}

// kubeletRoot returns the form of kubelet's root dir that p is at or beneath.
func (a *AllowedBases) kubeletRoot(p string) (string, bool) {
	for _, kr := range a.kubeletRoots {
		if Within(p, kr) {
			return kr, true
		}
	}
	return "", false
}

// Paths returns the allowed bases as given, cleaned.
func (a *AllowedBases) Paths() []string {
	out := make([]string, 0, len(a.bases))
	for _, b := range a.bases {
		out = append(out, b.path)
	}
	slices.Sort(out)
	return out
}

// Within reports whether p is dir or lies beneath it. Both are cleaned and compared component
// by component, so /var/lib/dirpv2 is not within /var/lib/dirpv.
func Within(p, dir string) bool {
	p, dir = filepath.Clean(p), filepath.Clean(dir)
	if dir == "/" {
		return strings.HasPrefix(p, "/")
	}
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// Locate checks the local volume directory basePath/rel and returns the allowed base that
// holds it and the directory's path relative to that base, to be opened beneath the base with
// no symlink followed (Root.OpenDir). rel must be clean (CleanRelPath). Errors wrap
// ErrBaseNotAllowed and say what to change.
func (a *AllowedBases) Locate(basePath, rel string) (base, relToBase string, err error) {
	if _, err := CleanRelPath(rel); err != nil {
		return "", "", err
	}
	if !filepath.IsAbs(basePath) {
		return "", "", fmt.Errorf("base path %q is not absolute", basePath)
	}
	dir := filepath.Join(basePath, rel)
	for _, b := range a.bases {
		if !Within(basePath, b.path) {
			continue
		}
		relToBase, _ := filepath.Rel(b.path, dir)
		// The walk beneath the base follows no symlink, so the directory is where its path
		// says, the base's own symlinks (an admin's choice) aside: check both forms.
		for _, d := range []string{dir, filepath.Join(b.resolved, relToBase)} {
			if kr, ok := a.kubeletRoot(d); ok {
				return "", "", fmt.Errorf("%w: directory %s is inside kubelet's root dir %s, which holds every pod's volumes and secrets",
					ErrBaseNotAllowed, dir, kr)
			}
			for _, kr := range a.kubeletRoots {
				if Within(kr, d) {
					return "", "", fmt.Errorf("%w: directory %s contains kubelet's root dir %s, which holds every pod's volumes and secrets",
						ErrBaseNotAllowed, dir, kr)
				}
			}
		}
		return b.path, relToBase, nil
	}
	allowed := "none"
	if len(a.bases) > 0 {
		allowed = strings.Join(a.Paths(), ", ")
	}
	return "", "", fmt.Errorf("%w: base path %s is not at or beneath a base path this node allows (%s); "+
		"to use it, add it to dirpv node's --allowed-base-paths and mount it into the node plugin",
		ErrBaseNotAllowed, basePath, allowed)
}

// OpenSubRoot opens the directory rel beneath the root as a Root of its own, without following
// symlinks; with create, missing directories on the way are made (mode 0755). rel "" returns a
// Root on the same directory. Close the result independently of r.
func (r *Root) OpenSubRoot(rel string, create bool) (*Root, error) {
	path := r.path
	if rel != "" {
		path = r.path + "/" + rel
		if create {
			if err := r.mkdirParents(rel); err != nil {
				return nil, err
			}
		}
	}
	fd, err := r.openDir(rel, unix.O_PATH)
	if err != nil {
		return nil, err
	}
	return &Root{path: path, fd: fd, xattr: r.xattr}, nil
}

// mkdirParents makes every missing directory of rel beneath the root, one component at a time
// through descriptors opened without following symlinks.
func (r *Root) mkdirParents(rel string) error {
	if _, err := CleanRelPath(rel); err != nil {
		return err
	}
	fd, err := r.openDir("", unix.O_PATH)
	if err != nil {
		return err
	}
	defer func() { unix.Close(fd) }()
	components := strings.Split(rel, "/")
	for i, name := range components {
		sofar := strings.Join(components[:i+1], "/")
		if err := unix.Mkdirat(fd, name, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("mkdir %s in %s: %w", sofar, r.path, err)
		}
		next, err := unix.Openat2(fd, name, &unix.OpenHow{
			Flags:   uint64(unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC),
			Resolve: resolveBeneath,
		})
		if err != nil {
			return describeResolveError(r.path, sofar, err)
		}
		unix.Close(fd)
		fd = next
	}
	return nil
}
