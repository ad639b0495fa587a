package nfs3

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"
	"syscall"
	"time"

	nfsc "github.com/willscott/go-nfs-client/nfs"
	"github.com/willscott/go-nfs-client/nfs/rpc"
	"github.com/willscott/go-nfs-client/nfs/xdr"
)

// Procedures that go-nfs-client does not name.
const (
	procNull     = 0
	procLink     = 15
	procFSStat   = 18
	mountProcMnt = 1
	mountProcExp = 5
)

// Type aliases so callers need not import go-nfs-client themselves.
type (
	Fattr  = nfsc.Fattr
	Sattr3 = nfsc.Sattr3
)

// Error is a non-OK NFS3 or MOUNT3 status.
type Error struct {
	Op     string
	Status uint32
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (nfsstat3 %d)", e.Op, e.Errno(), e.Status)
}

// Errno maps the NFS status to the Linux errno a kernel client would return.
// Most nfsstat3 values equal their errno; the rest are translated as
// fs/nfs/nfs3xdr.c does.
func (e *Error) Errno() syscall.Errno {
	switch e.Status {
	case 1, 2, 5, 6, 13, 17, 18, 19, 20, 21, 22, 27, 28, 30, 31:
		return syscall.Errno(e.Status)
	case 63:
		return syscall.ENAMETOOLONG
	case 66:
		return syscall.ENOTEMPTY
	case 69:
		return syscall.EDQUOT
	case 70, 10001:
		return syscall.ESTALE
	case 71:
		return syscall.EREMOTE
	case 10004:
		return syscall.ENOTSUP
	case 10005:
		return syscall.ENAMETOOLONG
	case 10008:
		return syscall.EAGAIN // NFS3ERR_JUKEBOX
	default:
		return syscall.EIO
	}
}

// ToErrno maps any error from this package to an errno: NFS statuses keep
// their meaning, everything else (timeouts, lost connections, decode
// failures) becomes EIO, which is what a soft kernel mount reports.
func ToErrno(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var ne *Error
	if errors.As(err, &ne) {
		return ne.Errno()
	}
	return syscall.EIO
}

// Target is one mounted NFSv3 file system: an NFS client plus the root handle.
type Target struct {
	rpc  *Client
	Root []byte
	// RTMax/WTMax are the server's maximum READ/WRITE sizes (FSINFO).
	RTMax, WTMax uint32
}

// authSysParms is RFC 5531 authsys_parms. go-nfs-client's AuthUnix carries
// exactly one group; this one carries the supplementary groups too, which
// permission checks through group bits (e.g. a pod's fsGroup) rely on.
type authSysParms struct {
	Stamp   uint32
	Machine string
	UID     uint32
	GID     uint32
	GIDs    []uint32
}

// maxAuthGroups is the AUTH_SYS limit on supplementary groups.
const maxAuthGroups = 16

// Cred builds AUTH_SYS credentials; the server maps uid 0 per its squash
// setting. At most 16 supplementary groups are sent, as the protocol allows.
func Cred(uid, gid uint32, groups ...uint32) rpc.Auth {
	if len(groups) > maxAuthGroups {
		groups = groups[:maxAuthGroups]
	}
	if groups == nil {
		groups = []uint32{}
	}
	var b bytes.Buffer
	// Encoding a fixed struct into a buffer cannot fail.
	_ = xdr.Write(&b, &authSysParms{Stamp: uint32(time.Now().Unix()), Machine: "dirpv-nfs-fuse", UID: uid, GID: gid, GIDs: groups})
	return rpc.Auth{Flavor: 1, Body: b.Bytes()}
}

// status reads an nfsstat3 and turns non-zero into *Error.
func status(r io.Reader, op string) error {
	st, err := xdr.ReadUint32(r)
	if err != nil {
		return fmt.Errorf("%s: decoding status: %w", op, err)
	}
	if st != 0 {
		return &Error{Op: op, Status: st}
	}
	return nil
}

// idempotent procedures may be sent again after a lost connection, as the
// kernel client retransmits them; the others (CREATE, REMOVE, RENAME, ...)
// could then fail spuriously with EEXIST or ENOENT, so they are not.
var idempotent = map[uint32]bool{
	nfsc.NFSProc3GetAttr: true, nfsc.NFSProc3SetAttr: true, nfsc.NFSProc3Lookup: true,
	nfsc.NFSProc3Access: true, nfsc.NFSProc3Readlink: true, nfsc.NFSProc3Read: true,
	nfsc.NFSProc3Write: true, nfsc.NFSProc3ReadDirPlus: true, procFSStat: true,
	nfsc.NFSProc3FSInfo: true, nfsc.NFSProc3Commit: true,
}

func (t *Target) call(ctx context.Context, op string, proc uint32, cred rpc.Auth, args any) (*bytes.Reader, error) {
	r, err := t.rpc.Call(ctx, nfsc.Nfs3Prog, nfsc.Nfs3Vers, proc, cred, args)
	// A server restart or an idle-connection close shows up as a lost
	// connection on the next call: one retry on a fresh connection hides it.
	if err != nil && errors.Is(err, ErrConnLost) && idempotent[proc] && ctx.Err() == nil {
		r, err = t.rpc.Call(ctx, nfsc.Nfs3Prog, nfsc.Nfs3Vers, proc, cred, args)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if err := status(r, op); err != nil {
		return nil, err
	}
	return r, nil
}

// Mnt runs MOUNTPROC3_MNT for dirPath against the MOUNT service at mountAddr
// and returns the root file handle.
func Mnt(ctx context.Context, mountAddr, dirPath string, cred rpc.Auth) ([]byte, error) {
	c := NewClient(mountAddr, DefaultTimeout)
	defer c.Close()
	r, err := c.Call(ctx, nfsc.MountProg, nfsc.MountVers, mountProcMnt, cred, &struct{ Path string }{dirPath})
	if err != nil {
		return nil, fmt.Errorf("MNT %s: %w", dirPath, err)
	}
	if err := status(r, "MNT "+dirPath); err != nil {
		return nil, err
	}
	fh, err := xdr.ReadOpaque(r)
	if err != nil {
		return nil, fmt.Errorf("MNT %s: decoding handle: %w", dirPath, err)
	}
	return fh, nil
}

// Exports runs MOUNTPROC3_EXPORT and returns the exported directory names.
func Exports(ctx context.Context, mountAddr string) ([]string, error) {
	c := NewClient(mountAddr, DefaultTimeout)
	defer c.Close()
	r, err := c.Call(ctx, nfsc.MountProg, nfsc.MountVers, mountProcExp, rpc.AuthNull, nil)
	if err != nil {
		return nil, fmt.Errorf("EXPORT: %w", err)
	}
	var dirs []string
	for {
		var more bool
		if err := xdr.Read(r, &more); err != nil {
			return nil, fmt.Errorf("EXPORT: decoding list: %w", err)
		}
		if !more {
			return dirs, nil
		}
		var dir string
		if err := xdr.Read(r, &dir); err != nil {
			return nil, fmt.Errorf("EXPORT: decoding dir: %w", err)
		}
		dirs = append(dirs, dir)
		for { // groups: a linked list of names we do not need
			var g bool
			if err := xdr.Read(r, &g); err != nil {
				return nil, fmt.Errorf("EXPORT: decoding groups: %w", err)
			}
			if !g {
				break
			}
			var name string
			if err := xdr.Read(r, &name); err != nil {
				return nil, fmt.Errorf("EXPORT: decoding group: %w", err)
			}
		}
	}
}

// MountPath MOUNTs p. Servers differ in whether MNT accepts a directory below
// an export (kernel nfsd does, Ganesha does not), so on failure it MOUNTs the
// longest export that is a path prefix of p and returns the remaining path
// components, which the caller resolves with LOOKUP like mount.nfs would.
func MountPath(ctx context.Context, mountAddr, p string, cred rpc.Auth) (root []byte, rest []string, err error) {
	p = path.Clean("/" + p)
	root, mntErr := Mnt(ctx, mountAddr, p, cred)
	if mntErr == nil {
		return root, nil, nil
	}
	var ne *Error
	if !errors.As(mntErr, &ne) {
		return nil, nil, mntErr // transport trouble: no point in trying the others
	}
	exports, err := Exports(ctx, mountAddr)
	if err != nil {
		return nil, nil, errors.Join(mntErr, err)
	}
	best := ""
	for _, e := range exports {
		e = path.Clean("/" + e)
		if (p == e || e == "/" || strings.HasPrefix(p, e+"/")) && len(e) > len(best) {
			best = e
		}
	}
	if best == "" || best == p {
		return nil, nil, mntErr
	}
	root, err = Mnt(ctx, mountAddr, best, cred)
	if err != nil {
		return nil, nil, err
	}
	return root, strings.Split(strings.TrimPrefix(strings.TrimPrefix(p, best), "/"), "/"), nil
}

// NewTarget returns a client for the NFS service at addr rooted at root. It
// runs FSINFO to learn the transfer sizes, which doubles as a check that
// the handle is good.
func NewTarget(ctx context.Context, addr string, root []byte, cred rpc.Auth, timeout time.Duration) (*Target, error) {
	t := &Target{rpc: NewClient(addr, timeout), Root: root, RTMax: 1 << 20, WTMax: 1 << 20}
	r, err := t.call(ctx, "FSINFO", nfsc.NFSProc3FSInfo, cred, &struct{ FH []byte }{root})
	if err != nil {
		t.Close()
		return nil, err
	}
	var fi nfsc.FSInfo
	if err := xdr.Read(r, &fi); err != nil {
		t.Close()
		return nil, fmt.Errorf("FSINFO: decoding: %w", err)
	}
	if fi.RTMax > 0 && fi.RTMax < t.RTMax {
		t.RTMax = fi.RTMax
	}
	if fi.WTMax > 0 && fi.WTMax < t.WTMax {
		t.WTMax = fi.WTMax
	}
	return t, nil
}

// Close drops the connection.
func (t *Target) Close() { t.rpc.Close() }

// Null pings the NFS service.
func (t *Target) Null(ctx context.Context) error {
	_, err := t.rpc.Call(ctx, nfsc.Nfs3Prog, nfsc.Nfs3Vers, procNull, rpc.AuthNull, nil)
	return err
}

type postOpAttr = nfsc.PostOpAttr

// GetAttr runs GETATTR.
func (t *Target) GetAttr(ctx context.Context, cred rpc.Auth, fh []byte) (*Fattr, error) {
	r, err := t.call(ctx, "GETATTR", nfsc.NFSProc3GetAttr, cred, &struct{ FH []byte }{fh})
	if err != nil {
		return nil, err
	}
	var a Fattr
	if err := xdr.Read(r, &a); err != nil {
		return nil, fmt.Errorf("GETATTR: decoding: %w", err)
	}
	return &a, nil
}

// wccAfter decodes wcc_data and returns the post-op attributes, if any.
func wccAfter(r io.Reader) *Fattr {
	var w nfsc.WccData
	if xdr.Read(r, &w) != nil || !w.After.IsSet {
		return nil
	}
	return &w.After.Attr
}

// SetAttr runs an unguarded SETATTR and returns the new attributes (fetched
// with GETATTR when the server sends none).
func (t *Target) SetAttr(ctx context.Context, cred rpc.Auth, fh []byte, sa Sattr3) (*Fattr, error) {
	r, err := t.call(ctx, "SETATTR", nfsc.NFSProc3SetAttr, cred, &struct {
		FH    []byte
		Attr  Sattr3
		Guard bool
	}{fh, sa, false})
	if err != nil {
		return nil, err
	}
	if a := wccAfter(r); a != nil {
		return a, nil
	}
	return t.GetAttr(ctx, cred, fh)
}

// Lookup runs LOOKUP of name in dir.
func (t *Target) Lookup(ctx context.Context, cred rpc.Auth, dir []byte, name string) ([]byte, *Fattr, error) {
	r, err := t.call(ctx, "LOOKUP "+name, nfsc.NFSProc3Lookup, cred, &nfsc.Diropargs3{FH: dir, Filename: name})
	if err != nil {
		return nil, nil, err
	}
	var res struct {
		FH   []byte
		Attr postOpAttr
	}
	if err := xdr.Read(r, &res); err != nil {
		return nil, nil, fmt.Errorf("LOOKUP %s: decoding: %w", name, err)
	}
	if res.Attr.IsSet {
		return res.FH, &res.Attr.Attr, nil
	}
	a, err := t.GetAttr(ctx, cred, res.FH)
	return res.FH, a, err
}

// Readlink runs READLINK.
func (t *Target) Readlink(ctx context.Context, cred rpc.Auth, fh []byte) (string, error) {
	r, err := t.call(ctx, "READLINK", nfsc.NFSProc3Readlink, cred, &struct{ FH []byte }{fh})
	if err != nil {
		return "", err
	}
	var res struct {
		Attr postOpAttr
		Data string
	}
	if err := xdr.Read(r, &res); err != nil {
		return "", fmt.Errorf("READLINK: decoding: %w", err)
	}
	return res.Data, nil
}

// Read runs one READ of at most len(dest) (capped at RTMax) bytes.
func (t *Target) Read(ctx context.Context, cred rpc.Auth, fh []byte, off uint64, dest []byte) (int, bool, error) {
	n := uint32(len(dest))
	if n > t.RTMax {
		n = t.RTMax
	}
	r, err := t.call(ctx, "READ", nfsc.NFSProc3Read, cred, &struct {
		FH     []byte
		Offset uint64
		Count  uint32
	}{fh, off, n})
	if err != nil {
		return 0, false, err
	}
	var res struct {
		Attr  postOpAttr
		Count uint32
		EOF   bool
	}
	if err := xdr.Read(r, &res); err != nil {
		return 0, false, fmt.Errorf("READ: decoding: %w", err)
	}
	data, err := xdr.ReadOpaque(r)
	if err != nil {
		return 0, false, fmt.Errorf("READ: decoding data: %w", err)
	}
	return copy(dest, data), res.EOF, nil
}

// Stable-how values of WRITE.
const (
	Unstable = 0
	FileSync = 2
)

// Write runs WRITE calls until all of data is written.
func (t *Target) Write(ctx context.Context, cred rpc.Auth, fh []byte, off uint64, data []byte, stable uint32) (int, error) {
	done := 0
	for done < len(data) {
		chunk := data[done:]
		if uint32(len(chunk)) > t.WTMax {
			chunk = chunk[:t.WTMax]
		}
		r, err := t.call(ctx, "WRITE", nfsc.NFSProc3Write, cred, &struct {
			FH     []byte
			Offset uint64
			Count  uint32
			Stable uint32
			Data   []byte
		}{fh, off + uint64(done), uint32(len(chunk)), stable, chunk})
		if err != nil {
			return done, err
		}
		var res struct {
			Wcc   nfsc.WccData
			Count uint32
		}
		if err := xdr.Read(r, &res); err != nil {
			return done, fmt.Errorf("WRITE: decoding: %w", err)
		}
		if res.Count == 0 {
			return done, fmt.Errorf("WRITE: server wrote 0 bytes")
		}
		done += int(res.Count)
	}
	return done, nil
}

// Commit runs COMMIT for the whole file.
func (t *Target) Commit(ctx context.Context, cred rpc.Auth, fh []byte) error {
	_, err := t.call(ctx, "COMMIT", nfsc.NFSProc3Commit, cred, &struct {
		FH     []byte
		Offset uint64
		Count  uint32
	}{fh, 0, 0})
	return err
}

// created decodes the common CREATE/MKDIR/SYMLINK result, looking the new
// object up when the server omits its handle or attributes.
func (t *Target) created(ctx context.Context, cred rpc.Auth, op string, r io.Reader, dir []byte, name string) ([]byte, *Fattr, error) {
	var res struct {
		FH   nfsc.PostOpFH3
		Attr postOpAttr
	}
	if err := xdr.Read(r, &res); err != nil {
		return nil, nil, fmt.Errorf("%s: decoding: %w", op, err)
	}
	if res.FH.IsSet && res.Attr.IsSet {
		return res.FH.FH, &res.Attr.Attr, nil
	}
	return t.Lookup(ctx, cred, dir, name)
}

// Create runs CREATE; exclusive maps O_EXCL to GUARDED mode.
func (t *Target) Create(ctx context.Context, cred rpc.Auth, dir []byte, name string, mode uint32, exclusive bool) ([]byte, *Fattr, error) {
	how := uint32(0) // UNCHECKED
	if exclusive {
		how = 1 // GUARDED
	}
	r, err := t.call(ctx, "CREATE "+name, nfsc.NFSProc3Create, cred, &struct {
		Where nfsc.Diropargs3
		How   uint32
		Attr  Sattr3
	}{nfsc.Diropargs3{FH: dir, Filename: name}, how, Sattr3{Mode: nfsc.SetMode{SetIt: true, Mode: mode}}})
	if err != nil {
		return nil, nil, err
	}
	return t.created(ctx, cred, "CREATE "+name, r, dir, name)
}

// Mkdir runs MKDIR.
func (t *Target) Mkdir(ctx context.Context, cred rpc.Auth, dir []byte, name string, mode uint32) ([]byte, *Fattr, error) {
	r, err := t.call(ctx, "MKDIR "+name, nfsc.NFSProc3Mkdir, cred, &struct {
		Where nfsc.Diropargs3
		Attr  Sattr3
	}{nfsc.Diropargs3{FH: dir, Filename: name}, Sattr3{Mode: nfsc.SetMode{SetIt: true, Mode: mode}}})
	if err != nil {
		return nil, nil, err
	}
	return t.created(ctx, cred, "MKDIR "+name, r, dir, name)
}

// Symlink runs SYMLINK.
func (t *Target) Symlink(ctx context.Context, cred rpc.Auth, dir []byte, name, target string) ([]byte, *Fattr, error) {
	r, err := t.call(ctx, "SYMLINK "+name, nfsc.NFSProc3Symlink, cred, &struct {
		Where nfsc.Diropargs3
		Attr  Sattr3
		Data  string
	}{nfsc.Diropargs3{FH: dir, Filename: name}, Sattr3{Mode: nfsc.SetMode{SetIt: true, Mode: 0o777}}, target})
	if err != nil {
		return nil, nil, err
	}
	return t.created(ctx, cred, "SYMLINK "+name, r, dir, name)
}

// Link runs LINK (hard link of file as dir/name).
func (t *Target) Link(ctx context.Context, cred rpc.Auth, file, dir []byte, name string) error {
	_, err := t.call(ctx, "LINK "+name, procLink, cred, &struct {
		FH   []byte
		Link nfsc.Diropargs3
	}{file, nfsc.Diropargs3{FH: dir, Filename: name}})
	return err
}

// Remove runs REMOVE.
func (t *Target) Remove(ctx context.Context, cred rpc.Auth, dir []byte, name string) error {
	_, err := t.call(ctx, "REMOVE "+name, nfsc.NFSProc3Remove, cred, &nfsc.Diropargs3{FH: dir, Filename: name})
	return err
}

// Rmdir runs RMDIR.
func (t *Target) Rmdir(ctx context.Context, cred rpc.Auth, dir []byte, name string) error {
	_, err := t.call(ctx, "RMDIR "+name, nfsc.NFSProc3RmDir, cred, &nfsc.Diropargs3{FH: dir, Filename: name})
	return err
}

// Rename runs RENAME.
func (t *Target) Rename(ctx context.Context, cred rpc.Auth, fromDir []byte, from string, toDir []byte, to string) error {
	_, err := t.call(ctx, "RENAME "+from, nfsc.NFSProc3Rename, cred, &struct {
		From, To nfsc.Diropargs3
	}{nfsc.Diropargs3{FH: fromDir, Filename: from}, nfsc.Diropargs3{FH: toDir, Filename: to}})
	return err
}

// Entry is one READDIRPLUS entry.
type Entry struct {
	Name   string
	FileID uint64
	FH     []byte // nil if the server sent none
	Attr   *Fattr // nil if the server sent none
}

// ReadDirPlus lists a whole directory, "." and ".." excluded.
func (t *Target) ReadDirPlus(ctx context.Context, cred rpc.Auth, dir []byte) ([]Entry, error) {
	var (
		out    []Entry
		cookie uint64
		verf   uint64
	)
	for {
		r, err := t.call(ctx, "READDIRPLUS", nfsc.NFSProc3ReadDirPlus, cred, &struct {
			FH         []byte
			Cookie     uint64
			CookieVerf uint64
			DirCount   uint32
			MaxCount   uint32
		}{dir, cookie, verf, 16 << 10, 64 << 10})
		if err != nil {
			return nil, err
		}
		var head struct {
			DirAttr    postOpAttr
			CookieVerf uint64
		}
		if err := xdr.Read(r, &head); err != nil {
			return nil, fmt.Errorf("READDIRPLUS: decoding: %w", err)
		}
		verf = head.CookieVerf
		for {
			var more bool
			if err := xdr.Read(r, &more); err != nil {
				return nil, fmt.Errorf("READDIRPLUS: decoding: %w", err)
			}
			if !more {
				break
			}
			var e nfsc.EntryPlus
			if err := xdr.Read(r, &e); err != nil {
				return nil, fmt.Errorf("READDIRPLUS: decoding entry: %w", err)
			}
			cookie = e.Cookie
			if e.FileName == "." || e.FileName == ".." {
				continue
			}
			ent := Entry{Name: e.FileName, FileID: e.FileId}
			if e.Handle.IsSet {
				ent.FH = e.Handle.FH
			}
			if e.Attr.IsSet {
				a := e.Attr.Attr
				ent.Attr = &a
			}
			out = append(out, ent)
		}
		var eof bool
		if err := xdr.Read(r, &eof); err != nil {
			return nil, fmt.Errorf("READDIRPLUS: decoding eof: %w", err)
		}
		if eof {
			return out, nil
		}
	}
}

// FSStat is the FSSTAT result.
type FSStat struct {
	Attr                   postOpAttr
	TBytes, FBytes, ABytes uint64
	TFiles, FFiles, AFiles uint64
	Invarsec               uint32
}

// FSStat runs FSSTAT (statfs).
func (t *Target) FSStat(ctx context.Context, cred rpc.Auth, fh []byte) (*FSStat, error) {
	r, err := t.call(ctx, "FSSTAT", procFSStat, cred, &struct{ FH []byte }{fh})
	if err != nil {
		return nil, err
	}
	var st FSStat
	if err := xdr.Read(r, &st); err != nil {
		return nil, fmt.Errorf("FSSTAT: decoding: %w", err)
	}
	return &st, nil
}

// Access runs ACCESS and returns the subset of want the server grants.
func (t *Target) Access(ctx context.Context, cred rpc.Auth, fh []byte, want uint32) (uint32, error) {
	r, err := t.call(ctx, "ACCESS", nfsc.NFSProc3Access, cred, &struct {
		FH     []byte
		Access uint32
	}{fh, want})
	if err != nil {
		return 0, err
	}
	var res struct {
		Attr   postOpAttr
		Access uint32
	}
	if err := xdr.Read(r, &res); err != nil {
		return 0, fmt.Errorf("ACCESS: decoding: %w", err)
	}
	return res.Access, nil
}
