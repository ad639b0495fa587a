package provisioner

import (
	"fmt"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/dirpv/dirpv/volume"
)

// StorageClass parameter names.
const (
	ParamBackend     = "backend"
	ParamServer      = "server"
	ParamShare       = "share"
	ParamBasePath    = "basePath"
	ParamPathPattern = "pathPattern"
	ParamOnDelete    = "onDelete"
	ParamMode        = "mode"
	ParamUID         = "uid"
	ParamGID         = "gid"
	// ParamCapacityEnforcement says whether a local claim's size must be a filesystem limit.
	ParamCapacityEnforcement = "capacityEnforcement"
	// ParamBasePathMountPoint says whether a local base path must be a mount point
	// (BasePathMountPoint).
	ParamBasePathMountPoint = "basePathMountPoint"
)

// CapacityEnforcement is what a local class asks of the file system under its base path.
type CapacityEnforcement string

const (
	// EnforceBestEffort limits each volume to its claim's size where the base's file system
	// can (XFS or ext4 with prjquota, btrfs with quota) and provisions it unlimited, with an
	// event saying so, where it cannot: what dev clusters, whose nodes rarely have project
	// quota, need to work at all.
	EnforceBestEffort CapacityEnforcement = "bestEffort"
	// EnforceRequired refuses claims on a base that cannot enforce their size.
	EnforceRequired CapacityEnforcement = "required"
)

// DefaultBasePath is where local volumes live when a class names no basePath.
const DefaultBasePath = "/var/lib/dirpv"

// DefaultMode lets any pod user write to a new volume, as users of dev-cluster provisioners
// expect; classes that want less say so with mode, uid and gid.
const DefaultMode = 0o777

// OnDelete says what happens to a volume's directory when its PV is deleted.
type OnDelete string

const (
	// OnDeleteDelete removes the directory tree.
	OnDeleteDelete OnDelete = "delete"
	// OnDeleteRetain leaves the directory as it is.
	OnDeleteRetain OnDelete = "retain"
	// OnDeleteArchive renames the directory to archived-<name>-<time> beside it.
	OnDeleteArchive OnDelete = "archive"
)

func parseOnDelete(s string) (OnDelete, error) {
	switch d := OnDelete(s); d {
	case OnDeleteDelete, OnDeleteRetain, OnDeleteArchive:
		return d, nil
	}
	return "", fmt.Errorf("%s %s: want %q, %q or %q", ParamOnDelete, volume.Quote(s), OnDeleteDelete, OnDeleteRetain, OnDeleteArchive)
}

// classParams are a StorageClass's parameters, parsed and checked.
type classParams struct {
	backend  volume.Backend
	server   string
	share    string
	basePath string
	pattern  *pattern
	onDelete OnDelete
	owner    volume.Owner
	capacity CapacityEnforcement
	// mountPoint: the base path must be a mount point (local only).
	mountPoint bool
}

// parseParameters checks every parameter, so that a typo is reported on the claim rather than
// silently ignored.
func parseParameters(params map[string]string) (*classParams, error) {
	known := []string{ParamBackend, ParamServer, ParamShare, ParamBasePath, ParamPathPattern, ParamOnDelete, ParamMode, ParamUID, ParamGID, ParamCapacityEnforcement, ParamBasePathMountPoint}
	var unknown []string
	for k := range params {
		if !slices.Contains(known, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return nil, fmt.Errorf("unknown StorageClass parameters %s; known: %s", volume.QuoteList(unknown), strings.Join(known, ", "))
	}
	c := &classParams{
		backend:  volume.Backend(params[ParamBackend]),
		onDelete: OnDeleteDelete,
		// Without uid/gid the directory keeps the owner it was created with: chowning it to
		// root would fail on NFS exports that squash root.
		owner: volume.Owner{Mode: DefaultMode, UID: -1, GID: -1},
	}
	switch c.backend {
	case volume.BackendNFS:
		c.server, c.share = params[ParamServer], params[ParamShare]
		if c.server == "" || c.share == "" {
			return nil, fmt.Errorf("backend nfs needs parameters %s and %s", ParamServer, ParamShare)
		}
		for _, p := range []string{ParamBasePath, ParamCapacityEnforcement, ParamBasePathMountPoint} {
			if _, ok := params[p]; ok {
				// A client cannot set the server's quotas.
				return nil, fmt.Errorf("parameter %s is for backend local, not nfs", p)
			}
		}
	case volume.BackendLocal:
		c.basePath = params[ParamBasePath]
		if c.basePath == "" {
			c.basePath = DefaultBasePath
		}
		if !path.IsAbs(c.basePath) || path.Clean(c.basePath) != c.basePath || c.basePath == "/" {
			return nil, fmt.Errorf("%s %s must be a clean absolute path other than /", ParamBasePath, volume.Quote(c.basePath))
		}
		for _, p := range []string{ParamServer, ParamShare} {
			if _, ok := params[p]; ok {
				return nil, fmt.Errorf("parameter %s is for backend nfs, not local", p)
			}
		}
		c.capacity = EnforceBestEffort
		if s, ok := params[ParamCapacityEnforcement]; ok {
			switch e := CapacityEnforcement(s); e {
			case EnforceBestEffort, EnforceRequired:
				c.capacity = e
			default:
				return nil, fmt.Errorf("%s %s: want %q or %q", ParamCapacityEnforcement, volume.Quote(s), EnforceBestEffort, EnforceRequired)
			}
		}
		if s, ok := params[ParamBasePathMountPoint]; ok {
			switch m := BasePathMountPoint(s); m {
			case MountPointRequired, MountPointOptional:
				c.mountPoint = m == MountPointRequired
			default:
				return nil, fmt.Errorf("%s %s: want %q or %q", ParamBasePathMountPoint, volume.Quote(s), MountPointRequired, MountPointOptional)
			}
		}
	case "":
		return nil, fmt.Errorf("parameter %s is required: %q or %q", ParamBackend, volume.BackendNFS, volume.BackendLocal)
	default:
		return nil, fmt.Errorf("%s %s: want %q or %q", ParamBackend, volume.Quote(string(c.backend)), volume.BackendNFS, volume.BackendLocal)
	}
	// The export itself is checked the same way the node plugin will check the PV.
	probe := volume.Attributes{Backend: c.backend, Server: c.server, Share: c.share, BasePath: c.basePath, Path: "x"}
	if err := probe.Validate(); err != nil {
		return nil, err
	}

	pat := params[ParamPathPattern]
	if pat == "" {
		pat = DefaultPathPattern
	}
	var err error
	if c.pattern, err = parsePattern(pat); err != nil {
		return nil, err
	}
	if s, ok := params[ParamOnDelete]; ok {
		if c.onDelete, err = parseOnDelete(s); err != nil {
			return nil, err
		}
	}
	if s, ok := params[ParamMode]; ok {
		m, err := strconv.ParseUint(s, 8, 32)
		if err != nil || m > 0o7777 {
			return nil, fmt.Errorf("%s %s: want an octal mode such as 0770 or 2775", ParamMode, volume.Quote(s))
		}
		c.owner.Mode = uint32(m)
	}
	for name, id := range map[string]*int{ParamUID: &c.owner.UID, ParamGID: &c.owner.GID} {
		s, ok := params[name]
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(s, 10, 31)
		if err != nil {
			return nil, fmt.Errorf("%s %s: want a non-negative number", name, volume.Quote(s))
		}
		*id = int(n)
	}
	return c, nil
}
