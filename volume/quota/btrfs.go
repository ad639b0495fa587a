package quota

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// btrfs ioctls and structures from <linux/btrfs.h> and <linux/btrfs_tree.h>.
const (
	btrfsIocTreeSearch    = 0xd0009411 // _IOWR(0x94, 17, struct btrfs_ioctl_search_args)
	btrfsIocSubvolCreate  = 0x5000940e // _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
	btrfsIocInoLookup     = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	btrfsIocQgroupCreate  = 0x4010942a // _IOW(0x94, 42, struct btrfs_ioctl_qgroup_create_args)
	btrfsIocQgroupLimit   = 0x8030942b // _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
	btrfsQuotaTree        = 8
	btrfsQgroupStatusKey  = 240
	btrfsQgroupInfoKey    = 242
	btrfsQgroupLimitKey   = 244
	btrfsFirstFreeObject  = 256 // the inode number of every subvolume's root directory
	btrfsLimitMaxRfer     = 1
	btrfsPathNameMax      = 4087
	btrfsSearchBufSize    = 4096 - 104
	btrfsSearchHeaderSize = 32
)

type btrfsVolArgs struct {
	Fd   int64
	Name [btrfsPathNameMax + 1]byte
}

type btrfsInoLookupArgs struct {
	Treeid, Objectid uint64
	Name             [4080]byte
}

type btrfsQgroupLimitArgs struct {
	Qgroupid                                  uint64
	Flags, MaxRfer, MaxExcl, RsvRfer, RsvExcl uint64
}

type btrfsQgroupCreateArgs struct {
	Create, Qgroupid uint64
}

type btrfsSearchKey struct {
	TreeID, MinObjectid, MaxObjectid, MinOffset, MaxOffset, MinTransid, MaxTransid uint64
	MinType, MaxType, NrItems, _                                                   uint32
	_                                                                              [4]uint64
}

type btrfsSearchArgs struct {
	Key btrfsSearchKey
	Buf [btrfsSearchBufSize]byte
}

type btrfsSearchHeader struct {
	Transid, Objectid, Offset uint64
	Type, Len                 uint32
}

func ioctl(fd int, req uintptr, arg unsafe.Pointer) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

// btrfsQuotaItem returns the body of the quota tree's item (0, typ, offset), or nil if there
// is none. It fails with ENOENT where quota is off (there is no quota tree).
func btrfsQuotaItem(fd int, typ uint32, offset uint64) ([]byte, error) {
	args := btrfsSearchArgs{Key: btrfsSearchKey{
		TreeID: btrfsQuotaTree, MinOffset: offset, MaxOffset: offset, MaxTransid: ^uint64(0),
		MinType: typ, MaxType: typ, NrItems: 1,
	}}
	if err := ioctl(fd, btrfsIocTreeSearch, unsafe.Pointer(&args)); err != nil {
		return nil, fmt.Errorf("BTRFS_IOC_TREE_SEARCH: %w", err)
	}
	if args.Key.NrItems == 0 {
		return nil, nil
	}
	h := (*btrfsSearchHeader)(unsafe.Pointer(&args.Buf[0]))
	if h.Type != typ || h.Offset != offset || h.Objectid != 0 || int(h.Len) > btrfsSearchBufSize-btrfsSearchHeaderSize {
		return nil, nil
	}
	return append([]byte(nil), args.Buf[btrfsSearchHeaderSize:btrfsSearchHeaderSize+h.Len]...), nil
}

func probeBtrfs(fd int) error {
	b, err := btrfsQuotaItem(fd, btrfsQgroupStatusKey, 0)
	if err != nil {
		return err
	}
	if b == nil {
		return errors.New("no qgroup status item")
	}
	return nil
}

// CreateSubvolume creates the btrfs subvolume name in the directory open at parentFd. The
// kernel lets any user with write access to the directory do it, which is how a tenant makes
// a subvolume its volume's qgroup does not count (see volume/escapes.go).
func CreateSubvolume(parentFd int, name string) error {
	if len(name) > btrfsPathNameMax {
		return unix.ENAMETOOLONG
	}
	var args btrfsVolArgs
	copy(args.Name[:], name)
	if err := ioctl(parentFd, btrfsIocSubvolCreate, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("BTRFS_IOC_SUBVOL_CREATE: %w", err)
	}
	return nil
}

// btrfsSubvolID returns the ID of the subvolume whose root directory is open at fd. A plain
// directory is refused: a limit set through it would be its parent subvolume's.
func btrfsSubvolID(fd int) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("stat: %w", err)
	}
	if st.Ino != btrfsFirstFreeObject {
		return 0, fmt.Errorf("directory (inode %d) is not a btrfs subvolume", st.Ino)
	}
	args := btrfsInoLookupArgs{Objectid: btrfsFirstFreeObject}
	if err := ioctl(fd, btrfsIocInoLookup, unsafe.Pointer(&args)); err != nil {
		return 0, fmt.Errorf("BTRFS_IOC_INO_LOOKUP: %w", err)
	}
	return args.Treeid, nil
}

// btrfsLimit sets the referenced-bytes limit of qgroup 0/sub (bytes 0: none).
func btrfsLimit(fd int, sub, bytes uint64) error {
	args := btrfsQgroupLimitArgs{Qgroupid: sub, Flags: btrfsLimitMaxRfer, MaxRfer: bytes}
	if bytes == 0 {
		args.MaxRfer = ^uint64(0)
	}
	if err := ioctl(fd, btrfsIocQgroupLimit, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("limit qgroup 0/%d (BTRFS_IOC_QGROUP_LIMIT): %w", sub, err)
	}
	return nil
}

func btrfsUsage(fd int, sub uint64) (Usage, error) {
	info, err := btrfsQuotaItem(fd, btrfsQgroupInfoKey, sub)
	if err != nil {
		return Usage{}, fmt.Errorf("read qgroup 0/%d: %w", sub, err)
	}
	if len(info) < 16 {
		return Usage{}, fmt.Errorf("read qgroup 0/%d: no such qgroup", sub)
	}
	// struct btrfs_qgroup_info_item: generation, rfer, ... (little endian on disk and in
	// the search buffer).
	u := Usage{UsedBytes: binary.LittleEndian.Uint64(info[8:])}
	lim, err := btrfsQuotaItem(fd, btrfsQgroupLimitKey, sub)
	if err != nil {
		return Usage{}, fmt.Errorf("read limit of qgroup 0/%d: %w", sub, err)
	}
	// struct btrfs_qgroup_limit_item: flags, max_rfer, ...
	if len(lim) >= 16 && binary.LittleEndian.Uint64(lim)&btrfsLimitMaxRfer != 0 && binary.LittleEndian.Uint64(lim[8:]) != ^uint64(0) {
		u.LimitBytes = binary.LittleEndian.Uint64(lim[8:])
	}
	return u, nil
}

// btrfsDestroyQgroup removes qgroup 0/sub of a deleted subvolume. Subvolume IDs are never
// reused, so a qgroup the kernel will not yet let go of (its subvolume is still being cleaned
// up) blocks nothing and is left; newer kernels remove it themselves.
func btrfsDestroyQgroup(fd int, sub uint64) error {
	args := btrfsQgroupCreateArgs{Create: 0, Qgroupid: sub}
	err := ioctl(fd, btrfsIocQgroupCreate, unsafe.Pointer(&args))
	if err == nil || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EBUSY) {
		return nil
	}
	return fmt.Errorf("remove qgroup 0/%d: %w", sub, err)
}

// btrfs snapshot ioctls, from <linux/btrfs.h>.
const (
	btrfsIocSnapCreateV2 = 0x50009417 // _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)
	btrfsIocSnapDestroy  = 0x5000940f // _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
	btrfsSubvolRdonly    = 1 << 1
	btrfsSubvolNameMax   = 4039
	// btrfsIocGetSubvolRootref is _IOWR(0x94, 61, struct btrfs_ioctl_get_subvol_rootref_args)
	// (Linux 4.18, no privilege needed).
	btrfsIocGetSubvolRootref = 0xd000943d
	btrfsMaxRootrefItems     = 255
)

type btrfsGetSubvolRootrefArgs struct {
	MinTreeid uint64
	Rootref   [btrfsMaxRootrefItems]struct{ Treeid, Dirid uint64 }
	NumItems  uint8
	_         [7]uint8
}

type btrfsVolArgsV2 struct {
	Fd             int64
	Transid, Flags uint64
	_              [4]uint64
	Name           [btrfsSubvolNameMax + 1]byte
}

// ErrNoSnapshot wraps every reason Snapshot cannot be used, so that the caller copies instead.
var ErrNoSnapshot = errors.New("no btrfs snapshot possible")

// IsSubvolume reports whether the directory open at fd is the root of a btrfs subvolume.
func IsSubvolume(fd int) bool {
	var sfs unix.Statfs_t
	var st unix.Stat_t
	return unix.Fstatfs(fd, &sfs) == nil && uint32(sfs.Type) == unix.BTRFS_SUPER_MAGIC &&
		unix.Fstat(fd, &st) == nil && st.Ino == btrfsFirstFreeObject
}

// Snapshot makes name in the directory open at parentFd a snapshot of the btrfs subvolume
// whose root is open at srcFd (any flags but O_PATH), read-only if readOnly. Where quota is
// on, the snapshot gets a qgroup of its own, with no limit. It fails with an error wrapping
// ErrNoSnapshot if srcFd is no subvolume, holds nested subvolumes, or parentFd is on another
// file system.
func Snapshot(srcFd, parentFd int, name string, readOnly bool) error {
	if !IsSubvolume(srcFd) {
		return fmt.Errorf("%w: the source is not a btrfs subvolume", ErrNoSnapshot)
	}
	if len(name) > btrfsSubvolNameMax {
		return unix.ENAMETOOLONG
	}
	if err := checkNoNestedSubvolumes(srcFd); err != nil {
		return err
	}
	args := btrfsVolArgsV2{Fd: int64(srcFd)}
	if readOnly {
		args.Flags = btrfsSubvolRdonly
	}
	copy(args.Name[:], name)
	err := ioctl(parentFd, btrfsIocSnapCreateV2, unsafe.Pointer(&args))
	if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOTTY) {
		return fmt.Errorf("%w: BTRFS_IOC_SNAP_CREATE_V2: %w", ErrNoSnapshot, err)
	}
	if err != nil {
		return fmt.Errorf("BTRFS_IOC_SNAP_CREATE_V2: %w", err)
	}
	return nil
}

// checkNoNestedSubvolumes fails, wrapping ErrNoSnapshot, if the subvolume open at fd holds
// other subvolumes (a pod can make them in its volume): a snapshot does not descend into
// them, it would leave an empty directory where each one is. It asks btrfs for the
// subvolume's root references, which costs the same whatever the tree's size.
func checkNoNestedSubvolumes(fd int) error {
	var args btrfsGetSubvolRootrefArgs
	err := ioctl(fd, btrfsIocGetSubvolRootref, unsafe.Pointer(&args))
	switch {
	case errors.Is(err, unix.EOVERFLOW):
		return fmt.Errorf("%w: the source holds more than %d nested subvolumes, which a snapshot would leave empty", ErrNoSnapshot, btrfsMaxRootrefItems)
	case err != nil:
		return fmt.Errorf("%w: list nested subvolumes (BTRFS_IOC_GET_SUBVOL_ROOTREF): %w", ErrNoSnapshot, err)
	case args.NumItems > 0:
		return fmt.Errorf("%w: the source holds %d nested subvolumes, which a snapshot would leave empty", ErrNoSnapshot, args.NumItems)
	}
	return nil
}

// DeleteSubvolume deletes the btrfs subvolume name in the directory open at parentFd, read-only
// or not, with what it holds (nested subvolumes excepted: it fails then), and its qgroup where
// quota is on. A missing name is not an error.
func DeleteSubvolume(parentFd int, name string) error {
	fd, err := unix.Openat(parentFd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open subvolume %s: %w", name, err)
	}
	sub, err := btrfsSubvolID(fd)
	unix.Close(fd)
	if err != nil {
		return err
	}
	if len(name) > btrfsPathNameMax {
		return unix.ENAMETOOLONG
	}
	var args btrfsVolArgs
	copy(args.Name[:], name)
	if err := ioctl(parentFd, btrfsIocSnapDestroy, unsafe.Pointer(&args)); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("delete subvolume %s (BTRFS_IOC_SNAP_DESTROY): %w", name, err)
	}
	if probeBtrfs(parentFd) != nil {
		return nil // quota is off: there is no qgroup
	}
	return btrfsDestroyQgroup(parentFd, sub)
}
