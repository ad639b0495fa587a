package quota

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// golang.org/x/sys/unix has neither struct fsxattr with its ioctls nor the quotactl
// structures, so they are defined here from <linux/fs.h> and <linux/quota.h>.

// fsxattr is struct fsxattr.
type fsxattr struct {
	Xflags     uint32
	Extsize    uint32
	Nextents   uint32
	Projid     uint32
	Cowextsize uint32
	_          [8]byte
}

const (
	fsIocFsgetxattr    = 0x801c581f // _IOR('X', 31, struct fsxattr)
	fsIocFssetxattr    = 0x401c5820 // _IOW('X', 32, struct fsxattr)
	fsXflagProjinherit = 0x00000200

	prjQuota  = 2
	qGetInfo  = 0x800005
	qGetQuota = 0x800007
	qSetQuota = 0x800008
	// qXGetQStat is Q_XGETQSTAT, XQM_CMD(5); its struct fs_quota_stat has qs_flags, a u16,
	// at offset 2.
	qXGetQStat     = 'X'<<8 + 5
	fsQuotaPdqEnfd = 0x0020
	qifBlimits     = 1
	qifIlimits     = 4
	// qifDqblksize is the unit of if_dqblk's block limits.
	qifDqblksize = 1024

	maxProjectID = 1<<32 - 1
)

// ifDqblk is struct if_dqblk.
type ifDqblk struct {
	Bhardlimit, Bsoftlimit, Curspace  uint64
	Ihardlimit, Isoftlimit, Curinodes uint64
	Btime, Itime                      uint64
	Valid                             uint32
	_                                 uint32
}

// ifDqinfo is struct if_dqinfo.
type ifDqinfo struct {
	Bgrace, Igrace uint64
	Flags, Valid   uint32
}

func qcmd(cmd, typ uint32) uintptr { return uintptr(cmd<<8 | typ&0xff) }

// quotactlFd is quotactl_fd(2) (Linux 5.14): quotactl by any file on the file system, so no
// block device has to be found (and trusted) from the mount table.
func quotactlFd(fd int, cmd uint32, id uint32, addr unsafe.Pointer) error {
	_, _, e := unix.Syscall6(unix.SYS_QUOTACTL_FD, uintptr(fd), qcmd(cmd, prjQuota), uintptr(id), uintptr(addr), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// probeProject succeeds if project quota accounting and enforcement are on: XFS can account
// without enforcing (pqnoenforce).
func probeProject(fd int) error {
	var info ifDqinfo
	if err := quotactlFd(fd, qGetInfo, 0, unsafe.Pointer(&info)); err != nil {
		return fmt.Errorf("quotactl Q_GETINFO: %w", err)
	}
	var stat [256]byte // struct fs_quota_stat is 80 bytes
	if err := quotactlFd(fd, qXGetQStat, 0, unsafe.Pointer(&stat)); err != nil {
		return fmt.Errorf("quotactl Q_XGETQSTAT: %w", err)
	}
	if flags := binary.NativeEndian.Uint16(stat[2:]); flags&fsQuotaPdqEnfd == 0 {
		return fmt.Errorf("project quota is accounted but not enforced (flags %#x)", flags)
	}
	return nil
}

func getProject(fd int, id uint32) (ifDqblk, error) {
	var q ifDqblk
	err := quotactlFd(fd, qGetQuota, id, unsafe.Pointer(&q))
	return q, err
}

// setProjectLimit sets project id's hard block limit to bytes (0: none) and clears its other
// limits.
func setProjectLimit(fd int, id uint32, bytes uint64) error {
	q := ifDqblk{Bhardlimit: bytes / qifDqblksize, Valid: qifBlimits | qifIlimits}
	if err := quotactlFd(fd, qSetQuota, id, unsafe.Pointer(&q)); err != nil {
		return fmt.Errorf("set limit of project %d: %w", id, err)
	}
	return nil
}

// readProject reads project id's quota; a project XFS has no dquot for reads as all zeros.
func readProject(fd int, id uint32) (ifDqblk, error) {
	q, err := getProject(fd, id)
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ESRCH):
		return ifDqblk{}, nil
	case err != nil:
		return ifDqblk{}, fmt.Errorf("read quota of project %d: %w", id, err)
	}
	return q, nil
}

// charged reports whether any file is charged to the project. A directory of dirpv's holds at
// least its own inode once its ID is set, so a project charged nothing is not a live volume's.
func (q ifDqblk) charged() bool { return q.Curinodes != 0 || q.Curspace != 0 }

// limited reports whether the project has any limit, hard or soft, on blocks or inodes.
func (q ifDqblk) limited() bool {
	return q.Bhardlimit != 0 || q.Bsoftlimit != 0 || q.Ihardlimit != 0 || q.Isoftlimit != 0
}

// releaseProject clears the limit of project id unless files are charged to it.
func releaseProject(fd int, id uint32) error {
	projectMu.Lock()
	defer projectMu.Unlock()
	q, err := readProject(fd, id)
	if err != nil || q.charged() || !q.limited() {
		return err
	}
	return setProjectLimit(fd, id, 0)
}

// unlimitProject clears the limit of project id if the directory open at fd is in it.
func unlimitProject(fd int, id uint32) error {
	projectMu.Lock()
	defer projectMu.Unlock()
	own, err := projectOf(fd)
	if err != nil || own != id {
		return err
	}
	return setProjectLimit(fd, id, 0)
}

// candidates are the project IDs tried for a directory with inode ino: the inode number first
// (unique among live directories of one file system, so concurrent provisioners and restarts
// do not collide), then numbers derived from it, for inodes beyond 32 bits or an ID someone
// else uses.
func candidates(ino uint64) []uint32 {
	var ids []uint32
	if ino > 0 && ino <= maxProjectID {
		ids = append(ids, uint32(ino))
	}
	for i := range 64 {
		h := fnv.New32a()
		h.Write([]byte(strconv.FormatUint(ino, 10) + "/" + strconv.Itoa(i)))
		// The upper half of the range, clear of the small IDs admins hand out by hand.
		ids = append(ids, h.Sum32()|1<<31)
	}
	return ids
}

// setProject gives the directory at fd an unused project ID (no files charged, no limits), with
// the inherit flag and a hard limit of bytes.
func (f *FS) setProject(fd int, bytes uint64) (ID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return ID{}, fmt.Errorf("stat: %w", err)
	}
	projectMu.Lock()
	defer projectMu.Unlock()
	for _, id := range candidates(st.Ino) {
		q, err := readProject(fd, id)
		if err != nil {
			return ID{}, err
		}
		// A limited project with no files yet is one an admin (or a volume whose Release has
		// not run yet) set up: its limit is not ours to overwrite.
		if q.charged() || q.limited() {
			continue
		}
		// The ID goes on before the limit. A crash in between leaves a directory (still under
		// its temporary name, never handed out) charged to an unlimited project, which is
		// free again once the retry removes it; the other order would leave a limited project
		// with no files, which nothing ever hands out or clears.
		if err := setProjectID(fd, id); err != nil {
			return ID{}, err
		}
		if err := setProjectLimit(fd, id, bytes); err != nil {
			return ID{}, err
		}
		return ID{Kind: Project, Num: uint64(id)}, nil
	}
	return ID{}, fmt.Errorf("no free project ID among the candidates for inode %d", st.Ino)
}

func getFsxattr(fd int) (fsxattr, error) {
	var x fsxattr
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFsgetxattr, uintptr(unsafe.Pointer(&x))); e != 0 {
		return x, fmt.Errorf("FS_IOC_FSGETXATTR: %w", e)
	}
	return x, nil
}

// projectOf is the project ID of the file open at fd, 0 if none.
func projectOf(fd int) (uint32, error) {
	x, err := getFsxattr(fd)
	return x.Projid, err
}

// setProjectID gives the directory open at fd project id and the inherit flag, so that what
// is created in it is charged to id too.
func setProjectID(fd int, id uint32) error {
	return setFsxattr(fd, func(x *fsxattr) {
		x.Projid = id
		x.Xflags |= fsXflagProjinherit
	})
}

// setFsxattr reads the file's fsxattr, changes it with change and writes it back.
func setFsxattr(fd int, change func(*fsxattr)) error {
	x, err := getFsxattr(fd)
	if err != nil {
		return err
	}
	change(&x)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fsIocFssetxattr, uintptr(unsafe.Pointer(&x))); e != 0 {
		return fmt.Errorf("set project ID %d (FS_IOC_FSSETXATTR): %w", x.Projid, e)
	}
	return nil
}

func projectUsage(fd int, id uint32) (Usage, error) {
	q, err := getProject(fd, id)
	if err != nil {
		return Usage{}, fmt.Errorf("read quota of project %d: %w", id, err)
	}
	return Usage{
		UsedBytes: q.Curspace, LimitBytes: q.Bhardlimit * qifDqblksize,
		HasInodes: true, UsedInodes: q.Curinodes, LimitInodes: q.Ihardlimit,
	}, nil
}

// FileProject is the project ID of the file open at fd (0: none), as FS_IOC_FSGETXATTR reads it
// on XFS and ext4.
func FileProject(fd int) (uint32, error) { return projectOf(fd) }

// SetFileProject moves the file open at fd into project id, leaving its flags as they are, as
// `chattr -p` does. The kernel allows it to the file's owner and to CAP_FOWNER in the initial
// user namespace, and refuses it (EINVAL) to any process in another user namespace: this is
// how the VM tier measures what a pod can do to its volume's quota (test/vm/node/projid).
func SetFileProject(fd int, id uint32) error {
	return setFsxattr(fd, func(x *fsxattr) { x.Projid = id })
}
