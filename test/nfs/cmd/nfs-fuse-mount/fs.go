package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	nfsc "github.com/willscott/go-nfs-client/nfs"
	"github.com/willscott/go-nfs-client/nfs/rpc"

	"github.com/dirpv/dirpv/test/nfs/internal/nfs3"
)

// nfsFS is the state shared by all nodes of one mount.
type nfsFS struct {
	t        *nfs3.Target
	nfsAddr  string
	readOnly bool
	timeout  time.Duration
}

func getPort(ctx context.Context, host string, prog, vers uint32) (int, error) {
	return nfs3.GetPort(ctx, host, prog, vers)
}

// connect MOUNTs the export, resolves the sub-directory and checks that it is
// a directory, failing the way mount.nfs does when it is missing.
func connect(ctx context.Context, a *mountArgs, timeout time.Duration) (*nfsFS, error) {
	mountAddr, err := resolvePort(ctx, a.host, a.mountPort, nfsc.MountProg, nfsc.MountVers)
	if err != nil {
		return nil, fmt.Errorf("finding the MOUNT service on %s: %w", a.host, err)
	}
	nfsAddr, err := resolvePort(ctx, a.host, a.port, nfsc.Nfs3Prog, nfsc.Nfs3Vers)
	if err != nil {
		return nil, fmt.Errorf("finding the NFS service on %s: %w", a.host, err)
	}
	cred := nfs3.Cred(0, 0)
	root, rest, err := nfs3.MountPath(ctx, mountAddr, a.path, cred)
	if err != nil {
		return nil, describe(err)
	}
	t, err := nfs3.NewTarget(ctx, nfsAddr, root, cred, timeout)
	if err != nil {
		return nil, describe(err)
	}
	fh := root
	for _, name := range rest {
		if fh, _, err = t.Lookup(ctx, cred, fh, name); err != nil {
			t.Close()
			return nil, describe(err)
		}
	}
	// MNT may hand out a handle for a non-directory; mount.nfs refuses those.
	attr, err := t.GetAttr(ctx, cred, fh)
	if err != nil {
		t.Close()
		return nil, describe(err)
	}
	if attr.Type != nfsc.NF3Dir {
		t.Close()
		return nil, fmt.Errorf("reason given by server: Not a directory (%s)", a.path)
	}
	t.Root = fh
	return &nfsFS{t: t, nfsAddr: nfsAddr, readOnly: a.readOnly, timeout: timeout}, nil
}

// describe phrases an NFS status like mount.nfs ("reason given by server: No
// such file or directory") so callers matching on that text keep working.
func describe(err error) error {
	if e := nfs3.ToErrno(err); e != syscall.EIO {
		return fmt.Errorf("reason given by server: %s (%w)", capitalize(e.Error()), err)
	}
	return err
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	b := []byte(s)
	if b[0] >= 'a' && b[0] <= 'z' {
		b[0] -= 'a' - 'A'
	}
	return string(b)
}

func mountFUSE(a *mountArgs, fsys *nfsFS) (*fuse.Server, error) {
	root := &node{fsys: fsys, fh: fsys.t.Root}
	// Short caches: tests check server-side changes through the mount and
	// vice versa, and kernel NFS revalidates within seconds too.
	entry, attr, neg := time.Second, time.Second, time.Duration(0)
	flags := uintptr(syscall.MS_NOSUID | syscall.MS_NODEV)
	if a.readOnly {
		flags |= syscall.MS_RDONLY // the kernel then refuses writes with EROFS
	}
	opts := &fs.Options{
		EntryTimeout:    &entry,
		AttrTimeout:     &attr,
		NegativeTimeout: &neg,
		MountOptions: fuse.MountOptions{
			AllowOther:        true, // pods run as other users
			FsName:            a.source,
			Name:              "nfs", // type shows as fuse.nfs
			DirectMount:       true,
			DirectMountStrict: true, // no fusermount fallback: we are root
			DirectMountFlags:  flags,
			MaxWrite:          1 << 20,
			DisableXAttrs:     true,
		},
		UID: 0, GID: 0,
	}
	return fs.Mount(a.target, root, opts)
}

func handleSignals(srv *fuse.Server, target string) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	<-ch
	if err := srv.Unmount(); err != nil {
		// Busy: detach it lazily so the target is not left dead.
		_ = syscall.Unmount(target, syscall.MNT_DETACH)
	}
}

// node is one NFS object, identified by its file handle.
type node struct {
	fs.Inode
	fsys  *nfsFS
	fh    []byte
	dirty atomic.Bool // unstable WRITEs since the last COMMIT
}

var (
	_ fs.NodeGetattrer  = (*node)(nil)
	_ fs.NodeSetattrer  = (*node)(nil)
	_ fs.NodeLookuper   = (*node)(nil)
	_ fs.NodeReaddirer  = (*node)(nil)
	_ fs.NodeMkdirer    = (*node)(nil)
	_ fs.NodeCreater    = (*node)(nil)
	_ fs.NodeUnlinker   = (*node)(nil)
	_ fs.NodeRmdirer    = (*node)(nil)
	_ fs.NodeRenamer    = (*node)(nil)
	_ fs.NodeOpener     = (*node)(nil)
	_ fs.NodeReader     = (*node)(nil)
	_ fs.NodeWriter     = (*node)(nil)
	_ fs.NodeFlusher    = (*node)(nil)
	_ fs.NodeFsyncer    = (*node)(nil)
	_ fs.NodeStatfser   = (*node)(nil)
	_ fs.NodeSymlinker  = (*node)(nil)
	_ fs.NodeReadlinker = (*node)(nil)
	_ fs.NodeLinker     = (*node)(nil)
)

// op gives one FUSE operation its own deadline (all the RPCs it makes share it)
// and the caller's credentials, so the server applies its own permission
// checks and squashing to the real user.
func (n *node) op(ctx context.Context) (context.Context, context.CancelFunc, rpc.Auth) {
	uid, gid := uint32(0), uint32(0)
	var groups []uint32
	if c, ok := fuse.FromContext(ctx); ok {
		uid, gid = c.Uid, c.Gid
		if uid != 0 { // root needs none (and is squashed anyway if so configured)
			groups = supplementaryGroups(c.Pid)
		}
	}
	// Deliberately not derived from the request context: go-fuse cancels
	// that on FUSE_INTERRUPT, which the kernel sends whenever the caller
	// gets any signal - and Go programs get SIGURG for goroutine preemption
	// all the time. Aborting then would turn writes into spurious EIO (and
	// drop the shared connection). Like a kernel NFS mount, only the
	// deadline ends an operation.
	ctx, cancel := context.WithTimeout(context.Background(), n.fsys.timeout)
	return ctx, cancel, nfs3.Cred(uid, gid, groups...)
}

// supplementaryGroups reads the caller's groups from /proc, as FUSE passes
// only uid, gid and pid. A vanished process just gets none.
func supplementaryGroups(pid uint32) []uint32 {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/status")
	if err != nil {
		return nil
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Groups:"); ok {
			var out []uint32
			for _, f := range strings.Fields(rest) {
				if g, err := strconv.ParseUint(f, 10, 32); err == nil {
					out = append(out, uint32(g))
				}
			}
			return out
		}
	}
	return nil
}

func (n *node) t() *nfs3.Target { return n.fsys.t }

func (n *node) logErr(op string, err error) syscall.Errno {
	e := nfs3.ToErrno(err)
	if e == syscall.EIO {
		fmt.Fprintf(os.Stderr, "%s nfs-fuse-mount: %s: %v\n", time.Now().Format(time.RFC3339), op, err)
	}
	return e
}

var typeBits = map[uint32]uint32{
	nfsc.NF3Reg: syscall.S_IFREG, nfsc.NF3Dir: syscall.S_IFDIR, nfsc.NF3Blk: syscall.S_IFBLK,
	nfsc.NF3Chr: syscall.S_IFCHR, nfsc.NF3Lnk: syscall.S_IFLNK, nfsc.NF3Sock: syscall.S_IFSOCK,
	nfsc.NF3FIFO: syscall.S_IFIFO,
}

func fillAttr(a *nfs3.Fattr, out *fuse.Attr) {
	out.Ino = a.Fileid
	out.Mode = typeBits[a.Type] | a.FileMode&0o7777
	out.Nlink = a.Nlink
	out.Owner = fuse.Owner{Uid: a.UID, Gid: a.GID}
	out.Size = a.Filesize
	out.Blocks = (a.Used + 511) / 512
	out.Blksize = 1 << 16
	out.Rdev = mkdev(a.SpecData[0], a.SpecData[1])
	out.Atime, out.Atimensec = uint64(a.Atime.Seconds), a.Atime.Nseconds
	out.Mtime, out.Mtimensec = uint64(a.Mtime.Seconds), a.Mtime.Nseconds
	out.Ctime, out.Ctimensec = uint64(a.Ctime.Seconds), a.Ctime.Nseconds
}

// mkdev encodes a device number the way the Linux kernel's new_encode_dev does.
func mkdev(major, minor uint32) uint32 {
	return (minor & 0xff) | (major&0xfff)<<8 | (minor&^0xff)<<12
}

// child wraps a handle in an Inode; go-fuse returns the existing Inode when
// the NFS fileid (our inode number) is already known.
func (n *node) child(ctx context.Context, fh []byte, a *nfs3.Fattr, out *fuse.EntryOut) *fs.Inode {
	fillAttr(a, &out.Attr)
	return n.NewInode(ctx, &node{fsys: n.fsys, fh: fh}, fs.StableAttr{Mode: typeBits[a.Type], Ino: a.Fileid})
}

// Access answers access(2) with the server's ACCESS verdict, which knows the
// caller's supplementary groups, ACLs and squashing (go-fuse's default
// check looks at mode bits with the primary group only).
func (n *node) Access(ctx context.Context, mask uint32) syscall.Errno {
	isDir := n.StableAttr().Mode&syscall.S_IFMT == syscall.S_IFDIR
	var want uint32
	if mask&4 != 0 { // R_OK
		want |= nfsc.ACCESS3_READ
	}
	if mask&2 != 0 { // W_OK
		want |= nfsc.ACCESS3_MODIFY | nfsc.ACCESS3_EXTEND
		if isDir {
			want |= nfsc.ACCESS3_DELETE
		}
	}
	if mask&1 != 0 { // X_OK
		if isDir {
			want |= nfsc.ACCESS3_LOOKUP
		} else {
			want |= nfsc.ACCESS3_EXECUTE
		}
	}
	if want == 0 { // F_OK: existence, which lookup already proved
		return 0
	}
	if mask&2 != 0 && n.fsys.readOnly {
		return syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	got, err := n.t().Access(ctx, cred, n.fh, want)
	if err != nil {
		return n.logErr("access", err)
	}
	if got&want != want {
		return syscall.EACCES
	}
	return 0
}

func (n *node) Getattr(ctx context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	a, err := n.t().GetAttr(ctx, cred, n.fh)
	if err != nil {
		return n.logErr("getattr", err)
	}
	fillAttr(a, &out.Attr)
	return 0
}

func (n *node) Setattr(ctx context.Context, _ fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	if n.fsys.readOnly {
		return syscall.EROFS
	}
	var sa nfs3.Sattr3
	if m, ok := in.GetMode(); ok {
		sa.Mode = nfsc.SetMode{SetIt: true, Mode: m & 0o7777}
	}
	if u, ok := in.GetUID(); ok {
		sa.UID = nfsc.SetUID{SetIt: true, UID: u}
	}
	if g, ok := in.GetGID(); ok {
		sa.GID = nfsc.SetUID{SetIt: true, UID: g}
	}
	if s, ok := in.GetSize(); ok {
		sa.Size = nfsc.SetSize{SetIt: true, Size: s}
	}
	sa.Atime = setTime(in.Valid, fuse.FATTR_ATIME, fuse.FATTR_ATIME_NOW, in.Atime, in.Atimensec)
	sa.Mtime = setTime(in.Valid, fuse.FATTR_MTIME, fuse.FATTR_MTIME_NOW, in.Mtime, in.Mtimensec)
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	a, err := n.t().SetAttr(ctx, cred, n.fh, sa)
	if err != nil {
		return n.logErr("setattr", err)
	}
	fillAttr(a, &out.Attr)
	return 0
}

func setTime(valid, bit, now uint32, sec uint64, nsec uint32) nfsc.SetTime {
	switch {
	case valid&bit == 0:
		return nfsc.SetTime{}
	case valid&now != 0:
		return nfsc.SetTime{SetIt: nfsc.SetToServerTime}
	default:
		return nfsc.SetTime{SetIt: nfsc.SetToClientTime, Time: nfsc.NFS3Time{Seconds: uint32(sec), Nseconds: nsec}}
	}
}

func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	fh, a, err := n.t().Lookup(ctx, cred, n.fh, name)
	if err != nil {
		return nil, n.logErr("lookup", err)
	}
	return n.child(ctx, fh, a, out), 0
}

func (n *node) Readdir(ctx context.Context) (fs.DirStream, syscall.Errno) {
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	ents, err := n.t().ReadDirPlus(ctx, cred, n.fh)
	if err != nil {
		return nil, n.logErr("readdir", err)
	}
	// "." and ".." are not in the NFS listing we return but readdir(3)
	// users expect them; the kernel does not add them for FUSE.
	list := make([]fuse.DirEntry, 0, len(ents)+2)
	self := n.StableAttr().Ino
	parent := self
	if _, p := n.Parent(); p != nil {
		parent = p.StableAttr().Ino
	}
	list = append(list, fuse.DirEntry{Name: ".", Mode: syscall.S_IFDIR, Ino: self},
		fuse.DirEntry{Name: "..", Mode: syscall.S_IFDIR, Ino: parent})
	for _, e := range ents {
		de := fuse.DirEntry{Name: e.Name, Ino: e.FileID}
		if e.Attr != nil {
			de.Mode = typeBits[e.Attr.Type]
		}
		list = append(list, de)
	}
	return fs.NewListDirStream(list), 0
}

func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	if n.fsys.readOnly {
		return nil, syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	fh, a, err := n.t().Mkdir(ctx, cred, n.fh, name, mode&0o7777)
	if err != nil {
		return nil, n.logErr("mkdir", err)
	}
	return n.child(ctx, fh, a, out), 0
}

func (n *node) Create(ctx context.Context, name string, flags, mode uint32, out *fuse.EntryOut) (*fs.Inode, fs.FileHandle, uint32, syscall.Errno) {
	if n.fsys.readOnly {
		return nil, nil, 0, syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	fh, a, err := n.t().Create(ctx, cred, n.fh, name, mode&0o7777, flags&syscall.O_EXCL != 0)
	if err != nil {
		return nil, nil, 0, n.logErr("create", err)
	}
	return n.child(ctx, fh, a, out), nil, 0, 0
}

func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	if n.fsys.readOnly {
		return nil, syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	fh, a, err := n.t().Symlink(ctx, cred, n.fh, name, target)
	if err != nil {
		return nil, n.logErr("symlink", err)
	}
	return n.child(ctx, fh, a, out), 0
}

func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	s, err := n.t().Readlink(ctx, cred, n.fh)
	if err != nil {
		return nil, n.logErr("readlink", err)
	}
	return []byte(s), 0
}

func (n *node) Link(ctx context.Context, target fs.InodeEmbedder, name string, out *fuse.EntryOut) (*fs.Inode, syscall.Errno) {
	if n.fsys.readOnly {
		return nil, syscall.EROFS
	}
	src, ok := target.(*node)
	if !ok {
		return nil, syscall.EXDEV
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	if err := n.t().Link(ctx, cred, src.fh, n.fh, name); err != nil {
		return nil, n.logErr("link", err)
	}
	fh, a, err := n.t().Lookup(ctx, cred, n.fh, name)
	if err != nil {
		return nil, n.logErr("link", err)
	}
	return n.child(ctx, fh, a, out), 0
}

func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	if n.fsys.readOnly {
		return syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	if err := n.t().Remove(ctx, cred, n.fh, name); err != nil {
		return n.logErr("unlink", err)
	}
	return 0
}

func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	if n.fsys.readOnly {
		return syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	if err := n.t().Rmdir(ctx, cred, n.fh, name); err != nil {
		return n.logErr("rmdir", err)
	}
	return 0
}

func (n *node) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	if n.fsys.readOnly {
		return syscall.EROFS
	}
	if flags != 0 {
		return syscall.EINVAL // RENAME_NOREPLACE/EXCHANGE: NFSv3 cannot, the kernel client says EINVAL too
	}
	dst, ok := newParent.(*node)
	if !ok {
		return syscall.EXDEV
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	if err := n.t().Rename(ctx, cred, n.fh, name, dst.fh, newName); err != nil {
		return n.logErr("rename", err)
	}
	return 0
}

func (n *node) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if n.fsys.readOnly && flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	// No per-open state: reads and writes go straight to the handle. The
	// kernel drops cached pages on open (no FOPEN_KEEP_CACHE), which gives
	// the close-to-open consistency NFS users expect.
	return nil, 0, 0
}

func (n *node) Read(ctx context.Context, _ fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	done := 0
	for done < len(dest) {
		got, eof, err := n.t().Read(ctx, cred, n.fh, uint64(off)+uint64(done), dest[done:])
		if err != nil {
			return nil, n.logErr("read", err)
		}
		done += got
		if eof || got == 0 {
			break
		}
	}
	return fuse.ReadResultData(dest[:done]), 0
}

func (n *node) Write(ctx context.Context, _ fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if n.fsys.readOnly {
		return 0, syscall.EROFS
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	// UNSTABLE + COMMIT on flush/fsync, like the kernel client: FILE_SYNC
	// would fsync on the server for every 1 MiB chunk.
	w, err := n.t().Write(ctx, cred, n.fh, uint64(off), data, nfs3.Unstable)
	if w > 0 {
		n.dirty.Store(true)
	}
	if err != nil && w == 0 {
		return 0, n.logErr("write", err)
	}
	return uint32(w), 0
}

func (n *node) commit(ctx context.Context, what string) syscall.Errno {
	if !n.dirty.Swap(false) {
		return 0
	}
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	if err := n.t().Commit(ctx, cred, n.fh); err != nil {
		n.dirty.Store(true)
		return n.logErr(what, err)
	}
	return 0
}

// Flush runs on every close(2): committing here gives close-to-open semantics.
func (n *node) Flush(ctx context.Context, _ fs.FileHandle) syscall.Errno {
	return n.commit(ctx, "flush")
}

func (n *node) Fsync(ctx context.Context, _ fs.FileHandle, _ uint32) syscall.Errno {
	return n.commit(ctx, "fsync")
}

func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	ctx, cancel, cred := n.op(ctx)
	defer cancel()
	st, err := n.t().FSStat(ctx, cred, n.fh)
	if err != nil {
		return n.logErr("statfs", err)
	}
	const bsize = 4096
	out.Bsize, out.Frsize, out.NameLen = bsize, bsize, 255
	out.Blocks, out.Bfree, out.Bavail = st.TBytes/bsize, st.FBytes/bsize, st.ABytes/bsize
	out.Files, out.Ffree = st.TFiles, st.FFiles
	return 0
}
