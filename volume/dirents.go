package volume

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"golang.org/x/sys/unix"
)

// dirBatch is how many names the walkers (Removal, the quota check's scan, the copier) read
// from a directory at a time: a tenant decides how many names its volume's directories hold,
// and a walk that listed a directory whole would hold them all.
const dirBatch = 1000

// dirent is one name read from a directory, its type as the directory records it (d_type,
// DT_UNKNOWN where the file system does not say), and the offset of the entry after it.
type dirent struct {
	name string
	typ  uint8
	off  int64
}

// errOffsetLost is returned when a directory cannot be read on from an offset on the
// descriptor given: FUSE file systems (the test NFS client among them) know an offset only on
// the descriptor that returned it, and overlayfs numbers a merged directory's entries per
// open. Only a read from the start works there.
var errOffsetLost = errors.New("the directory offset is not valid on this descriptor")

// refuseOffset, set by tests, is asked before each read whether to refuse reading fd from
// off, as FUSE does (errOffsetLost).
var refuseOffset func(fd int, off int64) bool

// dirReader reads a directory a batch of names at a time, from an offset, into a buffer it
// keeps: one reader serves a whole walk.
type dirReader struct{ buf []byte }

// read returns up to max names of the directory open at fd from offset off on, "." and ".."
// left out, in out's storage; none at the end of the directory. It moves fd's offset. Where
// off (not 0) cannot be read from on fd it fails with an error wrapping errOffsetLost.
func (d *dirReader) read(fd int, off int64, out []dirent, max int) ([]dirent, error) {
	if d.buf == nil {
		d.buf = make([]byte, 32<<10)
	}
	if refuseOffset != nil && refuseOffset(fd, off) {
		return nil, errOffsetLost
	}
	if _, err := unix.Seek(fd, off, io.SeekStart); err != nil {
		if off != 0 && errors.Is(err, unix.EINVAL) {
			return nil, fmt.Errorf("seek: %w: %w", errOffsetLost, err)
		}
		return nil, fmt.Errorf("seek: %w", err)
	}
	for {
		n, err := unix.Getdents(fd, d.buf)
		if err != nil && off != 0 && errors.Is(err, unix.EINVAL) {
			return nil, fmt.Errorf("%w: %w", errOffsetLost, err)
		}
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return out[:0], nil
		}
		if out = parseDirents(d.buf[:n], out[:0], max); len(out) > 0 {
			return out, nil
		}
		// Only "." and "..", all taken: fd's offset is past them already.
	}
}

// parseDirents appends up to max names, "." and ".." left out, from buf as getdents64(2) fills
// it.
func parseDirents(buf []byte, out []dirent, max int) []dirent {
	for len(buf) >= direntNameOff && len(out) < max {
		off := int64(binary.NativeEndian.Uint64(buf[8:16]))
		reclen := int(binary.NativeEndian.Uint16(buf[16:18]))
		if reclen < direntNameOff || reclen > len(buf) {
			break
		}
		typ := buf[18]
		name := buf[direntNameOff:reclen]
		if i := bytes.IndexByte(name, 0); i >= 0 {
			name = name[:i]
		}
		if s := string(name); s != "." && s != ".." {
			out = append(out, dirent{name: s, typ: typ, off: off})
		}
		buf = buf[reclen:]
	}
	return out
}

// direntNameOff is where the name starts in a linux_dirent64: after d_ino, d_off, d_reclen
// and d_type.
const direntNameOff = 19
