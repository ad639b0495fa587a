package volume

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

// Escapes is what a quota check found in one volume: ways its tenant took data out of the
// volume's limit (SECURITY.md).
type Escapes struct {
	// Kind is the volume's limit: quota.Project (files and directories outside the volume's
	// project) or quota.Btrfs (nested subvolumes). Empty: the volume has no limit to escape.
	Kind quota.Kind
	// Found counts what is outside the limit; Example is one of them, its path relative to
	// the volume ("." for the volume's own directory).
	Found   int
	Example string
	// Repaired counts those moved back into the volume's project, a part of Found.
	Repaired int
	// Walked counts the files and directories the check looked at (project quotas only).
	Walked int
}

// FindEscapes checks that what the volume holds is charged to its limit, the one its marker
// records. With a project quota (XFS, ext4) it walks the tree and finds the regular files and
// directories charged to another project, and the directories that no longer pass the project
// on; with repair it moves each of them back (quota.MoveIntoProject), so that the tenant's
// data counts against its volume again. On btrfs it counts the nested subvolumes (which
// nothing here can fold into the volume's qgroup, and which are the tenant's data: they are
// only reported), without a walk.
//
// The walk makes the removal walker's promises: it never follows a symlink nor leaves the
// volume (every lookup is openat2 beneath the directory it starts from, going back up is
// checked against the directory it came down from), never crosses a mount, holds one directory
// open at a time whatever the depth and reads dirBatch names at a time. Other kinds of
// file (symlinks, devices, FIFOs, sockets) are not opened: the kernel changes a project ID
// only through an open file, and they hold no blocks a tenant could grow. ctx is checked
// between entries; a check it stops returns what it found so far with ctx's error.
func (v *Volume) FindEscapes(ctx context.Context, repair bool) (Escapes, error) {
	if v.marker.quota == "" {
		return Escapes{}, nil
	}
	id, err := quota.ParseID(v.marker.quota)
	if err != nil {
		return Escapes{}, fmt.Errorf("%s in %s: volume marker: %w", v.Rel(), v.root.path, err)
	}
	e := Escapes{Kind: id.Kind}
	if id.Kind == quota.Btrfs {
		e.Found, e.Example, err = quota.NestedSubvolumes(v.fd)
		if err != nil {
			err = fmt.Errorf("%s in %s: %w", v.Rel(), v.root.path, err)
		}
		return e, err
	}
	s, err := newScan(ctx, v.fd, uint32(id.Num), repair, &e)
	if err != nil {
		return e, fmt.Errorf("check %s in %s: %w", v.Rel(), v.root.path, err)
	}
	defer s.close()
	if err := s.run(); err != nil {
		return e, fmt.Errorf("check %s in %s: %w", v.Rel(), v.root.path, err)
	}
	return e, nil
}

// scan walks one volume for files outside its project.
type scan struct {
	ctx    context.Context
	id     uint32
	repair bool
	e      *Escapes
	mnt    uint64
	// cur is the directory being read, the last of stack.
	cur   int
	stack []scanLevel
	dirs  dirReader
	// failed is the first repair that failed, reported once the walk is done.
	failed error
	// dropDevices makes the walk remove the character and block device nodes it meets,
	// counting them in dropped, instead of checking projects (dropDeviceNodes).
	dropDevices bool
	dropped     int64
}

type scanLevel struct {
	name string
	at   devIno
	// children are names read and not looked at yet, at most a batch and only for the
	// deepest level; off is where the next read of the directory starts.
	children []dirent
	off      int64
}

func newScan(ctx context.Context, fd int, id uint32, repair bool, e *Escapes) (*scan, error) {
	s, err := openScan(ctx, fd)
	if err != nil {
		return nil, err
	}
	s.id, s.repair, s.e = id, repair, e
	if err := s.check(s.cur, ".", true); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// openScan starts a walk of the tree open at fd.
func openScan(ctx context.Context, fd int) (*scan, error) {
	s := &scan{ctx: ctx, cur: -1}
	var err error
	if s.mnt, err = mountID(fd); err != nil {
		return nil, err
	}
	if s.cur, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("duplicate directory handle: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(s.cur, &st); err != nil {
		s.close()
		return nil, fmt.Errorf("stat: %w", err)
	}
	s.stack = []scanLevel{{at: devIno{st.Dev, st.Ino}}}
	return s, nil
}

// dropDeviceNodes removes the character and block device nodes of the tree open at fd, a
// new volume no one else writes yet, and returns how many it removed. It walks as
// FindEscapes does, stat-ing only the names whose directory entry does not say they are
// something else.
func dropDeviceNodes(ctx context.Context, fd int) (int64, error) {
	s, err := openScan(ctx, fd)
	if err != nil {
		return 0, err
	}
	defer s.close()
	s.dropDevices = true
	err = s.run()
	return s.dropped, err
}

func (s *scan) close() {
	if s.cur >= 0 {
		unix.Close(s.cur)
		s.cur = -1
	}
}

// where names child of the current directory relative to the volume.
func (s *scan) where(child string) string {
	var b strings.Builder
	for _, l := range s.stack[1:] {
		b.WriteString(l.name)
		b.WriteByte('/')
	}
	b.WriteString(child)
	return b.String()
}

func (s *scan) run() error {
	for {
		if err := s.ctx.Err(); err != nil {
			return err
		}
		top := &s.stack[len(s.stack)-1]
		if len(top.children) == 0 {
			more, err := s.readBatch(top)
			if err != nil {
				return err
			}
			if !more {
				if len(s.stack) == 1 {
					return s.failed
				}
				if err := s.up(); err != nil {
					return err
				}
				continue
			}
		}
		child := top.children[0]
		top.children = top.children[1:]
		top.off = child.off
		if s.dropDevices && child.typ != unix.DT_UNKNOWN && child.typ != unix.DT_DIR &&
			child.typ != unix.DT_CHR && child.typ != unix.DT_BLK {
			continue
		}
		if err := s.entry(child.name); err != nil {
			return err
		}
	}
}

// readBatch reads up to dirBatch names of the current directory from top.off on, and
// reports false at its end. One pass: a directory offset stays valid on XFS and ext4 while
// the directory is only read, and names made behind it are left for the next check.
func (s *scan) readBatch(top *scanLevel) (bool, error) {
	fd, err := unix.Openat(s.cur, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("open %s: %w", s.where(""), err)
	}
	defer unix.Close(fd)
	children, err := s.dirs.read(fd, top.off, top.children, dirBatch)
	if err != nil {
		return false, fmt.Errorf("read directory %s: %w", s.where(""), err)
	}
	top.children = children
	return len(children) > 0, nil
}

// entry checks the entry name of the current directory, and descends into it if it is a
// directory on the same mount.
func (s *scan) entry(name string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(s.cur, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat %s: %w", s.where(name), err)
	}
	kind := st.Mode & unix.S_IFMT
	if s.dropDevices && (kind == unix.S_IFCHR || kind == unix.S_IFBLK) {
		// The directory keeps the times it had in the source, as in a copy.
		var dst unix.Stat_t
		if err := unix.Fstat(s.cur, &dst); err != nil {
			return fmt.Errorf("stat %s: %w", s.where(""), err)
		}
		if err := unix.Unlinkat(s.cur, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("remove device node %s: %w", s.where(name), err)
		}
		times := statTimes(&dst)
		if err := futimens(s.cur, &times); err != nil {
			return fmt.Errorf("set times of %s: %w", s.where(""), err)
		}
		s.dropped++
		return nil
	}
	if kind != unix.S_IFDIR && (s.dropDevices || kind != unix.S_IFREG) {
		return nil
	}
	flags := unix.O_RDONLY | unix.O_NONBLOCK | unix.O_NOATIME
	if kind == unix.S_IFDIR {
		flags |= unix.O_DIRECTORY
	}
	fd, err := openBeneath(s.cur, name, flags)
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ELOOP), errors.Is(err, unix.ENOTDIR):
		return nil // gone, or replaced by a symlink or something else meanwhile
	case err != nil:
		return fmt.Errorf("open %s: %w", s.where(name), err)
	}
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return fmt.Errorf("stat %s: %w", s.where(name), err)
	}
	if st.Mode&unix.S_IFMT != kind {
		unix.Close(fd)
		return nil
	}
	if kind == unix.S_IFDIR {
		if mnt, err := mountID(fd); err != nil || mnt != s.mnt {
			// A mount inside the volume is not the volume's; the removal refuses it too.
			unix.Close(fd)
			return err
		}
	}
	if s.dropDevices {
		// Only directories get here: nothing to check.
	} else if err := s.check(fd, name, kind == unix.S_IFDIR); err != nil {
		unix.Close(fd)
		return err
	}
	if kind != unix.S_IFDIR {
		return unix.Close(fd)
	}
	// Into the directory at once; what is left of this batch is read again on the way back,
	// so that only one batch of names is held whatever the depth.
	s.stack[len(s.stack)-1].children = nil
	s.stack = append(s.stack, scanLevel{name: name, at: devIno{st.Dev, st.Ino}})
	unix.Close(s.cur)
	s.cur = fd
	return nil
}

// check looks at the file open at fd, name in the current directory, and repairs it if asked.
func (s *scan) check(fd int, name string, dir bool) error {
	s.e.Walked++
	out, err := quota.OutsideProject(fd, s.id, dir)
	if err != nil {
		return fmt.Errorf("%s: %w", s.where(name), err)
	}
	if !out {
		return nil
	}
	s.e.Found++
	if s.e.Example == "" {
		s.e.Example = s.where(name)
		if name == "." {
			s.e.Example = "."
		}
	}
	if !s.repair {
		return nil
	}
	if err := quota.MoveIntoProject(fd, s.id, dir); err != nil {
		if s.failed == nil {
			s.failed = fmt.Errorf("move %s back into project %d: %w", s.where(name), s.id, err)
		}
		return nil
	}
	s.e.Repaired++
	return nil
}

// up goes back to the parent directory, checking it is the one the walk came down from.
func (s *scan) up() error {
	done := s.stack[len(s.stack)-1]
	s.stack = s.stack[:len(s.stack)-1]
	pfd, err := openParent(s.cur, s.stack[len(s.stack)-1].at)
	if err != nil {
		return fmt.Errorf("%s: %w", s.where(done.name), err)
	}
	unix.Close(s.cur)
	s.cur = pfd
	return nil
}
