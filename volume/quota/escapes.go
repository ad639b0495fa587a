package quota

import (
	"bytes"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// OutsideProject reports whether the file open at fd (read-only, not O_PATH) has left project
// id: it is charged to another project, or, for a directory, it no longer passes id on to
// what is made in it (its inherit flag was cleared, so new files there go to project 0).
// Either lets a tenant who owns the file write past its volume's limit (SECURITY.md).
func OutsideProject(fd int, id uint32, dir bool) (bool, error) {
	x, err := getFsxattr(fd)
	if err != nil {
		return false, err
	}
	return x.Projid != id || dir && x.Xflags&fsXflagProjinherit == 0, nil
}

// MoveIntoProject puts the file open at fd (read-only, not O_PATH) back into project id, a
// directory with the inherit flag again, so that what it holds is charged to id from now on.
// The kernel allows it to root (CAP_FOWNER) whatever the file's owner; a project over its
// limit takes the file all the same where the caller has CAP_SYS_RESOURCE (ext4) or
// CAP_FOWNER (XFS), as dirpv's node plugin does: the tenant's next write then fails.
func MoveIntoProject(fd int, id uint32, dir bool) error {
	return setFsxattr(fd, func(x *fsxattr) {
		x.Projid = id
		if dir {
			x.Xflags |= fsXflagProjinherit
		}
	})
}

const (
	// btrfsIocInoLookupUser is _IOWR(0x94, 62, struct btrfs_ioctl_ino_lookup_user_args)
	// (Linux 4.18): where a subvolume sits in its parent, no privilege needed.
	btrfsIocInoLookupUser     = 0xd000943e
	btrfsVolNameMax           = 255
	btrfsInoLookupUserPathMax = 4080 - btrfsVolNameMax - 1
)

type btrfsInoLookupUserArgs struct {
	Dirid, Treeid uint64
	Name          [btrfsVolNameMax + 1]byte
	Path          [btrfsInoLookupUserPathMax]byte
}

// NestedSubvolumes counts the btrfs subvolumes made directly inside the subvolume whose root
// is open at fd (any flags but O_PATH), whose data its qgroup does not count, and returns the
// path of one of them relative to that root (empty if there is none). It asks btrfs for the
// subvolume's root references, at a cost that does not grow with the tree: nothing is walked.
// Subvolumes nested in those are theirs, not counted again.
func NestedSubvolumes(fd int) (n int, example string, err error) {
	var args btrfsGetSubvolRootrefArgs
	var first struct{ treeid, dirid uint64 }
	for {
		err := ioctl(fd, btrfsIocGetSubvolRootref, unsafe.Pointer(&args))
		if err != nil && !errors.Is(err, unix.EOVERFLOW) {
			return 0, "", fmt.Errorf("list nested subvolumes (BTRFS_IOC_GET_SUBVOL_ROOTREF): %w", err)
		}
		if n == 0 && args.NumItems > 0 {
			first.treeid, first.dirid = args.Rootref[0].Treeid, args.Rootref[0].Dirid
		}
		n += int(args.NumItems)
		// EOVERFLOW: the buffer is full, and MinTreeid is set past its last item.
		if err == nil || args.NumItems == 0 {
			break
		}
	}
	if n == 0 {
		return 0, "", nil
	}
	lookup := btrfsInoLookupUserArgs{Dirid: first.dirid, Treeid: first.treeid}
	if err := ioctl(fd, btrfsIocInoLookupUser, unsafe.Pointer(&lookup)); err != nil {
		return n, "", fmt.Errorf("find nested subvolume %d (BTRFS_IOC_INO_LOOKUP_USER): %w", first.treeid, err)
	}
	// The path of the directory holding it ends with "/" unless that is the root; then its name.
	return n, cString(lookup.Path[:]) + cString(lookup.Name[:]), nil
}

func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}
