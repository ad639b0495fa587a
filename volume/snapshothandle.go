package volume

import (
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
)

// snapshotHandlePrefix starts every snapshot handle dirpv makes; the version lets a later
// format be told apart.
const snapshotHandlePrefix = "dirpv-snapshot-v1?"

// Keys of a snapshot handle beyond those of Attributes.
const (
	snapKeyName         = "name"
	snapKeyNode         = "node"
	snapKeySize         = "size"
	snapKeyMountOptions = "mountOptions"
)

// SnapshotHandle locates a snapshot from its ID alone: DeleteSnapshot and restore get nothing
// else, and by then the source PV and its class may be gone. Like Attributes, it carries
// nothing secret: it is stored in VolumeSnapshotContents, which users can read.
type SnapshotHandle struct {
	// Backend, and Server and Share (nfs) or BasePath (local), name the store the snapshot
	// lives in: the source volume's share or base path.
	Backend  Backend
	Server   string
	Share    string
	BasePath string
	// MountOptions are the source PV's, to mount its share the same way (nfs only).
	MountOptions []string
	// Node is the node holding a local snapshot (local only).
	Node string
	// Name is the snapshot's name in its store, one path component.
	Name string
	// Size is the source volume's capacity in bytes: what a restored claim must request at least.
	Size int64
}

// String renders the handle, a URL query behind a versioned prefix so that no value can be
// mistaken for a separator.
func (h SnapshotHandle) String() string {
	v := url.Values{}
	for k, s := range h.store().Map() {
		if k != AttrPath {
			v.Set(k, s)
		}
	}
	v.Set(snapKeyName, h.Name)
	v.Set(snapKeySize, strconv.FormatInt(h.Size, 10))
	if h.Node != "" {
		v.Set(snapKeyNode, h.Node)
	}
	if len(h.MountOptions) > 0 {
		v.Set(snapKeyMountOptions, strings.Join(h.MountOptions, ","))
	}
	return snapshotHandlePrefix + v.Encode()
}

// store is the handle as the Attributes of the snapshot's directory.
func (h SnapshotHandle) store() Attributes {
	return Attributes{Backend: h.Backend, Server: h.Server, Share: h.Share, BasePath: h.BasePath, Path: h.Name}
}

// Store returns the attributes of the snapshot's store with Path set to rel, for the same
// store lookup as a volume's.
func (h SnapshotHandle) Store(rel string) Attributes {
	a := h.store()
	a.Path = rel
	return a
}

// Validate checks that the handle names one snapshot directly in a valid store.
func (h SnapshotHandle) Validate() error {
	if h.Name == "" || strings.Contains(h.Name, "/") {
		return fmt.Errorf("snapshot name %s is not one path component", Quote(h.Name))
	}
	if err := h.store().Validate(); err != nil {
		return err
	}
	if (h.Backend == BackendLocal) != (h.Node != "") {
		return fmt.Errorf("a node is required for local snapshots and only for them")
	}
	if h.Size < 0 {
		return fmt.Errorf("negative size %d", h.Size)
	}
	if h.Backend != BackendNFS && len(h.MountOptions) > 0 {
		return fmt.Errorf("mount options are valid for backend nfs only")
	}
	return nil
}

// ParseSnapshotHandle reads and validates a handle made by SnapshotHandle.String. Keys it does
// not know are refused, as in ParseAttributes.
func ParseSnapshotHandle(s string) (SnapshotHandle, error) {
	q, ok := strings.CutPrefix(s, snapshotHandlePrefix)
	if !ok {
		return SnapshotHandle{}, fmt.Errorf("snapshot handle %s is not one of dirpv's", Quote(s))
	}
	v, err := url.ParseQuery(q)
	if err != nil {
		return SnapshotHandle{}, fmt.Errorf("snapshot handle %s: %w", Quote(s), err)
	}
	for k, vals := range v {
		known := []string{AttrBackend, AttrServer, AttrShare, AttrBasePath, snapKeyName, snapKeyNode, snapKeySize, snapKeyMountOptions}
		if !slices.Contains(known, k) {
			return SnapshotHandle{}, fmt.Errorf("snapshot handle %s: unknown key %s", Quote(s), Quote(k))
		}
		if len(vals) != 1 {
			return SnapshotHandle{}, fmt.Errorf("snapshot handle %s: key %s given %d times", Quote(s), k, len(vals))
		}
	}
	h := SnapshotHandle{
		Backend:  Backend(v.Get(AttrBackend)),
		Server:   v.Get(AttrServer),
		Share:    v.Get(AttrShare),
		BasePath: v.Get(AttrBasePath),
		Node:     v.Get(snapKeyNode),
		Name:     v.Get(snapKeyName),
	}
	if o := v.Get(snapKeyMountOptions); o != "" {
		h.MountOptions = strings.Split(o, ",")
	}
	if h.Size, err = strconv.ParseInt(v.Get(snapKeySize), 10, 64); err != nil {
		return SnapshotHandle{}, fmt.Errorf("snapshot handle %s: size: %w", Quote(s), err)
	}
	if err := h.Validate(); err != nil {
		return SnapshotHandle{}, fmt.Errorf("snapshot handle %s: %w", Quote(s), err)
	}
	return h, nil
}
