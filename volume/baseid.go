package volume

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// ErrBaseChanged marks a local base that is not the file system its volumes were made on: the
// disk meant to be mounted there did not mount (after a reboot, say), so the path leads to the
// directory underneath. Creating volumes there would put them on the wrong disk, hidden once
// the right one is back; deleting there would find nothing, succeed, and orphan the real
// volume and its quota for good. Retrying is right: it succeeds once the disk is back.
var ErrBaseChanged = errors.New("not the file system it was")

// A base's identity is a random ID kept on the base directory itself, so that it goes with the
// file system: in a trusted attribute where the file system has them (setting one needs
// CAP_SYS_ADMIN, so no tenant can copy it onto a directory of its own), else in a file of that
// name in the base, which no path pattern can reach (ReservedPrefix).
const (
	baseMarker = "trusted.dirpv.base"
	baseIDFile = ReservedPrefix + "base"
	// baseIDLen is the length of an ID in hex: 128 random bits.
	baseIDLen = 32
)

// baseXattr is the attribute the base's ID is kept in: tests that point the volume marker at
// an unsupported namespace (to exercise record files) get the ID file too.
func (r *Root) baseXattr() string {
	if r.xattr != volumeMarker {
		return r.xattr
	}
	return baseMarker
}

// BaseID returns the identity kept on the base, "" if it has none.
func (r *Root) BaseID() (string, error) {
	fd, err := r.openDir("", unix.O_RDONLY)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	buf := make([]byte, 64)
	n, err := unix.Fgetxattr(fd, r.baseXattr(), buf)
	switch {
	case err == nil:
		return checkBaseID(r.path, string(buf[:n]))
	case !errors.Is(err, unix.ENODATA) && !errors.Is(err, unix.ERANGE) && !xattrUnsupported(err):
		return "", fmt.Errorf("read base ID of %s: %w", r.path, err)
	case errors.Is(err, unix.ERANGE):
		return "", fmt.Errorf("base ID of %s is longer than an ID", r.path)
	}
	rfd, err := unix.Openat(fd, baseIDFile, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("open base ID file %s in %s: %w", baseIDFile, r.path, err)
	}
	f := os.NewFile(uintptr(rfd), baseIDFile)
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return "", fmt.Errorf("base ID file %s in %s is not a regular file (%v)", baseIDFile, r.path, err)
	}
	b, err := io.ReadAll(io.LimitReader(f, 64))
	if err != nil {
		return "", fmt.Errorf("read base ID file %s in %s: %w", baseIDFile, r.path, err)
	}
	return checkBaseID(r.path, strings.TrimSpace(string(b)))
}

func checkBaseID(base, id string) (string, error) {
	if _, err := hex.DecodeString(id); err != nil || len(id) != baseIDLen {
		return "", fmt.Errorf("base ID %q of %s is not an ID dirpv made", id, base)
	}
	return id, nil
}

// newBaseID gives the base a new random identity, durably, and returns it.
func (r *Root) newBaseID() (string, error) {
	var raw [baseIDLen / 2]byte
	rand.Read(raw[:]) // never fails (crypto/rand)
	id := hex.EncodeToString(raw[:])
	fd, err := r.openDir("", unix.O_RDONLY)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	err = unix.Fsetxattr(fd, r.baseXattr(), []byte(id), 0)
	switch {
	case err == nil:
		// The attribute must outlive a crash: a base whose ID vanished would be refused.
		if err := unix.Fsync(fd); err != nil {
			return "", fmt.Errorf("sync base ID of %s: %w", r.path, err)
		}
		return id, nil
	case !xattrUnsupported(err):
		return "", fmt.Errorf("write base ID of %s: %w", r.path, err)
	}
	// Written aside and renamed into place: a crash leaves the old ID or the new one.
	tmp := baseIDFile + ".new"
	wfd, err := unix.Openat(fd, tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return "", fmt.Errorf("create base ID file in %s: %w", r.path, err)
	}
	if err := writeSynced(wfd, tmp, []byte(id+"\n")); err != nil {
		return "", fmt.Errorf("base ID file in %s: %w", r.path, err)
	}
	if err := unix.Renameat(fd, tmp, fd, baseIDFile); err != nil {
		return "", fmt.Errorf("base ID file in %s: %w", r.path, err)
	}
	if err := unix.Fsync(fd); err != nil {
		return "", fmt.Errorf("sync %s: %w", r.path, err)
	}
	return id, nil
}

// BaseRecords remembers, in a directory of the node's own (not on any base), the identity of
// each local base that dirpv used on this node, and whether a volume was ever made or found
// there. A base that held volumes must keep its identity: if it carries another ID, or none,
// its disk is not the one it was (Check). A base that never held one may change freely, so an
// admin who creates a class before mounting its disk gets the disk, not a refusal.
//
// The records are the truth, read at each check: an admin who removes one (the base moved to
// a new disk on purpose, its volumes gone) is heard at once, without a restart.
type BaseRecords struct {
	dir string
	// mu serialises the changes of records, so that two adoptions of one base agree.
	mu sync.Mutex
}

// baseRecord is a record's stored form.
type baseRecord struct {
	// Path is the base path, for whoever reads the file.
	Path string `json:"basePath"`
	ID   string `json:"id"`
	// HeldVolumes says a volume was made or found there.
	HeldVolumes bool `json:"heldVolumes"`
}

// NewBaseRecords keeps records in dir, which is made on first use.
func NewBaseRecords(dir string) *BaseRecords { return &BaseRecords{dir: dir} }

// RecordPath is the file that holds the record of the base at path.
func (b *BaseRecords) RecordPath(path string) string {
	sum := sha256.Sum256([]byte(filepath.Clean(path)))
	return filepath.Join(b.dir, "base-"+hex.EncodeToString(sum[:8])+".json")
}

func (b *BaseRecords) read(path string) (*baseRecord, error) {
	file := b.RecordPath(path)
	data, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read record of base path %s: %w", path, err)
	}
	var rec baseRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, fmt.Errorf("record %s of base path %s: %w", file, path, err)
	}
	return &rec, nil
}

// write stores rec durably: written aside, synced and renamed into place.
func (b *BaseRecords) write(rec baseRecord) error {
	if err := os.MkdirAll(b.dir, 0o700); err != nil {
		return fmt.Errorf("record of base path %s: %w", rec.Path, err)
	}
	data, _ := json.Marshal(rec) // strings and a bool: cannot fail
	file := b.RecordPath(rec.Path)
	f, err := os.CreateTemp(b.dir, ".base-*.tmp")
	if err != nil {
		return fmt.Errorf("record of base path %s: %w", rec.Path, err)
	}
	defer os.Remove(f.Name())
	_, err = f.Write(append(data, '\n'))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("record of base path %s: %w", rec.Path, err)
	}
	if err := os.Rename(f.Name(), file); err != nil {
		return fmt.Errorf("record of base path %s: %w", rec.Path, err)
	}
	d, err := os.Open(b.dir)
	if err != nil {
		return fmt.Errorf("record of base path %s: %w", rec.Path, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("record of base path %s: sync %s: %w", rec.Path, b.dir, err)
	}
	return nil
}

// Held reports whether the record of the base at path says it held volumes. Such a base must
// be there already: it is never created.
func (b *BaseRecords) Held(path string) (bool, error) {
	rec, err := b.read(path)
	return rec != nil && rec.HeldVolumes, err
}

// Check makes sure that root, open at the base path path, is the base its record names, and
// fails with an error wrapping ErrBaseChanged if it held volumes and is not. A base without a
// record, or whose record says it never held a volume, is adopted: its ID (given one if it
// has none) is recorded. At adoption, a base that already holds entries (volumes made before
// dirpv kept records) counts as holding volumes.
func (b *BaseRecords) Check(path string, root *Root) error {
	path = filepath.Clean(path)
	id, err := root.BaseID()
	if err != nil {
		return err
	}
	rec, err := b.read(path)
	if err != nil {
		return err
	}
	if rec != nil && rec.ID == id {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	// Again under the lock: another call may have adopted the base meanwhile.
	if id, err = root.BaseID(); err != nil {
		return err
	}
	if rec, err = b.read(path); err != nil {
		return err
	}
	switch {
	case rec != nil && rec.ID == id:
		return nil
	case rec != nil && rec.HeldVolumes:
		return b.changed(path, rec, id, root)
	}
	held, err := holdsEntries(root)
	if err != nil {
		return err
	}
	if id == "" {
		if id, err = root.newBaseID(); err != nil {
			return err
		}
	}
	return b.write(baseRecord{Path: path, ID: id, HeldVolumes: held})
}

// changed is Check's refusal, saying what the admin sees and what to do.
func (b *BaseRecords) changed(path string, rec *baseRecord, id string, root *Root) error {
	found := "carries no dirpv base ID"
	if id != "" {
		found = "carries base ID " + id
	}
	var st unix.Stat_t
	where := ""
	if err := unix.Fstat(root.fd, &st); err == nil {
		where = fmt.Sprintf(" (on device %d:%d)", unix.Major(st.Dev), unix.Minor(st.Dev))
	}
	return fmt.Errorf("base path %s is %w: it held volumes on the file system with base ID %s, but the directory there now%s %s; "+
		"the disk meant to be mounted there is probably not mounted. dirpv creates and deletes no volume there until it is back, "+
		"and carries on by itself then. If the base was replaced on purpose and its volumes are gone, remove %s on this node",
		path, ErrBaseChanged, rec.ID, where, found, b.RecordPath(path))
}

// MarkHeld records that the base at path holds a volume: from now on it must keep its
// identity. The base was checked (Check) by the call that made or found the volume.
func (b *BaseRecords) MarkHeld(path string) error {
	path = filepath.Clean(path)
	b.mu.Lock()
	defer b.mu.Unlock()
	rec, err := b.read(path)
	if err != nil || rec == nil || rec.HeldVolumes {
		return err
	}
	rec.HeldVolumes = true
	return b.write(*rec)
}

// holdsEntries reports whether the base holds anything but what a new file system or dirpv's
// own bookkeeping puts there.
func holdsEntries(root *Root) (bool, error) {
	names, err := root.List("")
	if err != nil {
		return false, err
	}
	for _, n := range names {
		if n != "lost+found" && !strings.HasPrefix(n, ReservedPrefix) {
			return true, nil
		}
	}
	return false, nil
}
