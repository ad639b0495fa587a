// Package volume holds what the provisioner and the CSI node plugin share: the volume
// attributes written into each PV (the only contract between the two, so that Delete and
// NodePublishVolume never need the StorageClass) and filesystem operations confined beneath a
// base directory.
package volume

import (
	"fmt"
	"path"
	"sort"
	"strings"

	"github.com/dirpv/dirpv/volume/quota"
)

// Backend says where a volume's directory lives.
type Backend string

const (
	// BackendNFS volumes are subdirectories of an NFS export, mounted over NFS on every node.
	BackendNFS Backend = "nfs"
	// BackendLocal volumes are directories under a base path on one node, bind-mounted there.
	BackendLocal Backend = "local"
)

// Keys of the PV's spec.csi.volumeAttributes.
const (
	AttrBackend  = "backend"
	AttrServer   = "server"
	AttrShare    = "share"
	AttrBasePath = "basePath"
	AttrPath     = "path"
	AttrQuota    = "quota"
)

// Attributes locate a volume's directory. They are stored in the PV and carry nothing secret.
type Attributes struct {
	Backend Backend
	// Server and Share name the NFS export (nfs only).
	Server string
	Share  string
	// BasePath is the absolute host directory under which local volumes live (local only).
	BasePath string
	// Path is the volume's directory relative to the share or base path, already cleaned.
	Path string
	// Quota names the volume's size limit, quota.ID's string form (local only; empty where
	// the size is not enforced).
	Quota string
	// BaseMountPoint says the base path must be a mount point (local only): dirpv creates and
	// deletes nothing there while it is not. Not a volume attribute: the class says it, and
	// its PVs carry it in an annotation that an admin can remove, which spec.csi is not.
	BaseMountPoint bool
}

// Map renders the attributes as PV volumeAttributes.
func (a Attributes) Map() map[string]string {
	m := map[string]string{AttrBackend: string(a.Backend), AttrPath: a.Path}
	switch a.Backend {
	case BackendNFS:
		m[AttrServer] = a.Server
		m[AttrShare] = a.Share
	case BackendLocal:
		m[AttrBasePath] = a.BasePath
		if a.Quota != "" {
			m[AttrQuota] = a.Quota
		}
	}
	return m
}

// ParseAttributes reads and validates PV volumeAttributes. Keys it does not know are refused
// so that a hand-written PV with a typo fails loudly instead of mounting the wrong directory.
// Keys that kubelet adds itself (csi.storage.k8s.io/*) are allowed.
func ParseAttributes(m map[string]string) (Attributes, error) {
	var unknown []string
	for k := range m {
		switch k {
		case AttrBackend, AttrServer, AttrShare, AttrBasePath, AttrPath, AttrQuota:
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				unknown = append(unknown, k)
			}
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return Attributes{}, fmt.Errorf("unknown volume attributes %s", QuoteList(unknown))
	}
	a := Attributes{
		Backend:  Backend(m[AttrBackend]),
		Server:   m[AttrServer],
		Share:    m[AttrShare],
		BasePath: m[AttrBasePath],
		Path:     m[AttrPath],
		Quota:    m[AttrQuota],
	}
	return a, a.Validate()
}

// Validate checks that the attributes name one directory strictly inside its share or base.
func (a Attributes) Validate() error {
	if _, err := CleanRelPath(a.Path); err != nil {
		return fmt.Errorf("attribute %s: %w", AttrPath, err)
	}
	switch a.Backend {
	case BackendNFS:
		if a.Server == "" {
			return fmt.Errorf("attribute %s is required for backend nfs", AttrServer)
		}
		// A leading "-" would reach mount(8)'s argv as an option.
		if strings.ContainsAny(a.Server, "/ \t\n,") || strings.HasPrefix(a.Server, "-") {
			return fmt.Errorf("attribute %s %s is not a host name or address", AttrServer, Quote(a.Server))
		}
		if err := checkAbsDir(a.Share); err != nil {
			return fmt.Errorf("attribute %s: %w", AttrShare, err)
		}
		if a.BasePath != "" || a.Quota != "" {
			return fmt.Errorf("attributes %s and %s are not valid for backend nfs", AttrBasePath, AttrQuota)
		}
	case BackendLocal:
		if err := checkAbsDir(a.BasePath); err != nil {
			return fmt.Errorf("attribute %s: %w", AttrBasePath, err)
		}
		if a.Server != "" || a.Share != "" {
			return fmt.Errorf("attributes %s and %s are not valid for backend local", AttrServer, AttrShare)
		}
		if a.Quota != "" {
			if _, err := quota.ParseID(a.Quota); err != nil {
				return fmt.Errorf("attribute %s: %w", AttrQuota, err)
			}
		}
	default:
		return fmt.Errorf("attribute %s %s: want %q or %q", AttrBackend, Quote(string(a.Backend)), BackendNFS, BackendLocal)
	}
	return nil
}

// NFSSource is the mount source of the volume's own subdirectory, server:/share/path.
func (a Attributes) NFSSource() string {
	return ExportSource(a.Server, path.Join(a.Share, a.Path))
}

// ExportSource is the mount source of a directory on an NFS server, server:/dir, with an IPv6
// address in brackets as mount.nfs wants it.
func ExportSource(server, dir string) string {
	if strings.Contains(server, ":") && !strings.HasPrefix(server, "[") {
		server = "[" + server + "]"
	}
	return server + ":" + dir
}

func checkAbsDir(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("must not be empty")
	case !path.IsAbs(p):
		return fmt.Errorf("%s is not an absolute path", Quote(p))
	case path.Clean(p) != p:
		return fmt.Errorf("%s is not a clean path", Quote(p))
	case strings.ContainsRune(p, 0):
		return fmt.Errorf("contains a NUL byte")
	}
	return nil
}

// CleanRelPath accepts a relative, already clean path of one or more components and returns it
// unchanged. It refuses absolute paths, "." and ".." components, empty components and NUL
// bytes rather than cleaning them away: a path that needs cleaning came from somewhere that
// should not have produced it.
func CleanRelPath(rel string) (string, error) {
	if rel == "" {
		return "", fmt.Errorf("path is empty")
	}
	if strings.ContainsRune(rel, 0) {
		return "", fmt.Errorf("path %s contains a NUL byte", Quote(rel))
	}
	if strings.HasPrefix(rel, "/") {
		return "", fmt.Errorf("path %s is absolute, want a path relative to the base", Quote(rel))
	}
	for _, c := range strings.Split(rel, "/") {
		switch c {
		case "", ".", "..":
			return "", fmt.Errorf("path %s has an empty, \".\" or \"..\" component", Quote(rel))
		}
		if len(c) > MaxComponentLength {
			return "", fmt.Errorf("path %s has a component longer than %d bytes", Quote(rel), MaxComponentLength)
		}
	}
	return rel, nil
}

// MaxComponentLength is NAME_MAX on Linux file systems, NFS included.
const MaxComponentLength = 255
