package volume

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

// Claim identifies the claim a volume directory was made for. It is recorded in the volume's
// marker, so that a retried Provision of the same claim finds its own directory and any other
// claim mapping to the same path is refused.
type Claim struct {
	// UID is the claim's metadata.uid.
	UID string `json:"claimUID"`
	// PVName is the name of the PV made for the claim.
	PVName string `json:"pv"`
}

// ReservedPrefix starts every name dirpv keeps for itself beside volumes: owner records on file
// systems without trusted attributes and volumes being created. MkdirAll refuses paths with a
// component that starts with it, so no pathPattern can reach them.
const ReservedPrefix = ".dirpv-"

// ErrReservedName is returned by MkdirAll for a path with a component starting with ReservedPrefix.
var ErrReservedName = errors.New("starts with " + ReservedPrefix + ", which dirpv reserves for itself")

// ExistsError is returned by MkdirAll when the volume directory exists and was not made for
// the claim asking: it belongs to another claim, or dirpv's marker is not on it at all (made by
// someone else, or by a dirpv that did not record owners). Nothing on disk was changed.
type ExistsError struct {
	Path string
	// Marked says whether the directory carries a volume marker; Owner is the claim it names,
	// if any.
	Marked bool
	Owner  Claim
}

func (e *ExistsError) Error() string {
	return fmt.Sprintf("directory %s already exists and %s", e.Path, e.Reason())
}

// Reason says why the directory is not the claim's, without naming the claim it belongs to
// (which may be in another namespace).
func (e *ExistsError) Reason() string {
	switch {
	case !e.Marked:
		return "is not a volume dirpv made"
	case e.Owner.UID == "":
		return "its volume marker names no claim"
	}
	return "belongs to another claim"
}

// The volume marker. On file systems with trusted extended attributes (local bases) it is one,
// on the volume directory itself: setting or removing trusted.* needs CAP_SYS_ADMIN in the
// initial user namespace, so a pod can neither forge it on a directory of its own nor strip it
// from its volume, and it moves with the directory when it is renamed. NFS has no trusted
// attributes, and user.* ones would be the tenant's to change (they own the directory). There
// the marker is a record file beside the volume, in its parent, which tenants never see (they
// mount only the volume) and cannot write; it is named after the directory's inode number (NFS:
// its fileid, stable on the server), so it stays right through a rename within the parent.
const (
	volumeMarker = "trusted.dirpv.volume"
	// recordPrefix names owner records: recordPrefix + inode number.
	recordPrefix = ReservedPrefix + "vol-"
	// tempPrefix names volumes being created: tempPrefix + a hash of the claim and the name.
	tempPrefix = ReservedPrefix + "new-"
	// maxMarker bounds what is read back, whatever a record file grew to.
	maxMarker = 4096
)

// legacyMarker is what dirpv wrote before it recorded owners: a volume, owned by nobody known.
var legacyMarker = []byte("1")

// marker is what is known about one directory's volume marker.
type marker struct {
	marked bool
	owner  Claim
	// quota names the volume's size limit (quota.ID's string form), empty if it has none.
	quota string
}

// markerJSON is the marker's stored form.
type markerJSON struct {
	Claim
	Quota string `json:"quota,omitempty"`
}

func encodeMarker(c Claim, quota string) []byte {
	b, _ := json.Marshal(markerJSON{Claim: c, Quota: quota}) // strings only: cannot fail
	return b
}

func decodeMarker(b []byte) (marker, error) {
	if bytes.Equal(b, legacyMarker) {
		return marker{marked: true}, nil
	}
	var m markerJSON
	if err := json.Unmarshal(b, &m); err != nil {
		return marker{}, fmt.Errorf("volume marker %q: %w", b, err)
	}
	return marker{marked: true, owner: m.Claim, quota: m.Quota}, nil
}

// VolumeQuota reads the quota ID from the marker of the volume directory open at fd (its own
// trusted attribute: the local volumes that have quotas keep it there). ok is false if the
// directory has no marker or its marker names no quota.
func VolumeQuota(fd int) (id quota.ID, ok bool, err error) {
	buf := make([]byte, maxMarker)
	n, err := unix.Fgetxattr(fd, volumeMarker, buf)
	if errors.Is(err, unix.ENODATA) || xattrUnsupported(err) {
		return quota.ID{}, false, nil // NFS, or not a volume of dirpv's
	}
	if err != nil {
		return quota.ID{}, false, fmt.Errorf("read volume marker: %w", err)
	}
	m, err := decodeMarker(buf[:n])
	if err != nil || m.quota == "" {
		return quota.ID{}, false, err
	}
	id, err = quota.ParseID(m.quota)
	if err != nil {
		return quota.ID{}, false, fmt.Errorf("volume marker: %w", err)
	}
	return id, true, nil
}

// xattrUnsupported reports whether a trusted attribute cannot be used here, so that the record
// file is used instead. EPERM covers a process without CAP_SYS_ADMIN.
func xattrUnsupported(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.ENOSYS) ||
		errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES)
}

func recordName(fd int) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", fmt.Errorf("stat: %w", err)
	}
	return recordOf(st.Ino), nil
}

func recordOf(ino uint64) string { return recordPrefix + strconv.FormatUint(ino, 10) }

// readMarker reads the marker of the directory open at fd, whose parent is open at parentFd.
func (r *Root) readMarker(parentFd, fd int) (marker, error) {
	buf := make([]byte, maxMarker)
	n, err := unix.Fgetxattr(fd, r.xattr, buf)
	if err == nil {
		return decodeMarker(buf[:n])
	}
	if !errors.Is(err, unix.ENODATA) && !xattrUnsupported(err) {
		return marker{}, fmt.Errorf("read volume marker: %w", err)
	}
	name, err := recordName(fd)
	if err != nil {
		return marker{}, err
	}
	rfd, err := unix.Openat(parentFd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return marker{}, nil
	}
	if err != nil {
		return marker{}, fmt.Errorf("open volume record %s: %w", name, err)
	}
	f := os.NewFile(uintptr(rfd), name)
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return marker{}, fmt.Errorf("volume record %s is not a regular file (%v)", name, err)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxMarker))
	if err != nil {
		return marker{}, fmt.Errorf("read volume record %s: %w", name, err)
	}
	return decodeMarker(b)
}

// writeMarker marks the directory open at fd, in parentFd, as the volume of c, limited by
// the quota named quota (empty: none).
func (r *Root) writeMarker(parentFd, fd int, c Claim, quota string) error {
	b := encodeMarker(c, quota)
	switch err := unix.Fsetxattr(fd, r.xattr, b, 0); {
	case err == nil:
		return nil
	case !xattrUnsupported(err):
		return fmt.Errorf("set volume marker: %w", err)
	}
	name, err := recordName(fd)
	if err != nil {
		return err
	}
	// The directory was made just now, so a record already named after its inode is left from
	// a deleted directory whose inode was reused: truncate it.
	rfd, err := unix.Openat(parentFd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create volume record %s: %w", name, err)
	}
	if err := writeSynced(rfd, name, b); err != nil {
		return fmt.Errorf("volume record: %w", err)
	}
	return nil
}

// dropRecord removes the record file of the directory open at fd, if there is one.
func dropRecord(parentFd, fd int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("stat: %w", err)
	}
	return dropRecordOf(parentFd, st.Ino)
}

// dropRecordOf removes the record file of inode ino in parentFd, if there is one.
func dropRecordOf(parentFd int, ino uint64) error {
	if err := unix.Unlinkat(parentFd, recordOf(ino), 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove volume record %s: %w", recordOf(ino), err)
	}
	return nil
}

// tempName is where the volume name is made for c before it is marked and renamed into place:
// the same for every attempt of one claim, so a retry finds and removes what a crash left.
func tempName(c Claim, name string) string {
	sum := sha256.Sum256([]byte(c.UID + "\x00" + c.PVName + "\x00" + name))
	return tempPrefix + hex.EncodeToString(sum[:16])
}

// checkReserved refuses a path that names something dirpv keeps for itself.
func checkReserved(rel string) error {
	for _, c := range strings.Split(rel, "/") {
		if strings.HasPrefix(c, ReservedPrefix) {
			return fmt.Errorf("path %q: component %q %w", rel, c, ErrReservedName)
		}
	}
	return nil
}
