package csinode

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/internal/unmount"
)

// The mount table (/proc/mounts through mount.Interface.List) is read instead of stat-ing
// targets wherever possible: reading it never touches the mounted file system, so a dead NFS
// server cannot block the check.

// mountPathEscaper undoes what the kernel does to special characters in /proc/mounts fields.
var mountPathEscaper = strings.NewReplacer(" ", `\040`, "\t", `\011`, "\n", `\012`, `\`, `\134`)

// mountsAt returns the mount table entries mounted on target, bottom first (the last one is
// what a path lookup sees).
func (d *Driver) mountsAt(target string) ([]mount.MountPoint, error) {
	mps, err := d.mounter.List()
	if err != nil {
		return nil, fmt.Errorf("list mounts: %w", err)
	}
	escaped := mountPathEscaper.Replace(target)
	var out []mount.MountPoint
	for _, mp := range mps {
		if mp.Path == target || mp.Path == escaped {
			out = append(out, mp)
		}
	}
	return out, nil
}

// mountsOfSource returns the mount points whose source device is source, e.g. server:/share/p.
func (d *Driver) mountsOfSource(source string) ([]string, error) {
	mps, err := d.mounter.List()
	if err != nil {
		return nil, fmt.Errorf("list mounts: %w", err)
	}
	var out []string
	for _, mp := range mps {
		if mp.Device == source {
			out = append(out, mp.Path)
		}
	}
	return out, nil
}

// bindMountsOf returns mount points other than exclude whose root is the directory with the
// given device and inode, i.e. other bind mounts of a local volume. Only mounts of the same
// device are stat-ed, so no network file system is touched.
func bindMountsOf(ctx context.Context, scope *opScope, dev, ino uint64, exclude string) ([]string, error) {
	infos, err := mount.ParseMountInfo("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	var out []string
	for _, mi := range infos {
		if uint32(mi.Major) != unix.Major(dev) || uint32(mi.Minor) != unix.Minor(dev) {
			continue
		}
		if mi.MountPoint == exclude || mi.MountPoint == mountPathEscaper.Replace(exclude) {
			continue
		}
		var st unix.Stat_t
		err := scope.call(ctx, "stat "+mi.MountPoint, func() error { return unix.Stat(mi.MountPoint, &st) })
		if err != nil {
			// A mount point that vanished meanwhile or cannot be looked at is not ours.
			continue
		}
		if st.Dev == dev && st.Ino == ino {
			out = append(out, mi.MountPoint)
		}
	}
	return out, nil
}

// isReadOnly reports whether a mount table entry is read-only.
func isReadOnly(mp mount.MountPoint) bool { return slices.Contains(mp.Opts, "ro") }

// maxStackedMounts bounds the unmount loop: a target with more mounts stacked on it than this
// is not something dirpv made.
const maxStackedMounts = 8

// unmountAll unmounts everything mounted on target. A healthy mount is unmounted normally; a
// stale one (ENOTCONN/ESTALE/EIO) or one whose unmount does not finish in time is force- and
// then lazily unmounted so that the call returns and leaves no mount behind.
func (d *Driver) unmountAll(ctx context.Context, scope *opScope, target string) error {
	for i := 0; ; i++ {
		mps, err := d.mountsAt(target)
		if err != nil {
			return err
		}
		if len(mps) == 0 {
			return nil
		}
		if i == maxStackedMounts {
			return fmt.Errorf("%s is still mounted after %d unmounts", target, i)
		}
		if err := d.unmountOnce(ctx, scope, target); err != nil {
			return err
		}
	}
}

func (d *Driver) unmountOnce(ctx context.Context, scope *opScope, target string) error {
	logger := klog.FromContext(ctx)
	// A short probe tells a stale mount from a healthy one without waiting the whole budget.
	probe := scope.withTimeout(d.opts.OperationTimeout / 4)
	var st unix.Stat_t
	err := probe.call(ctx, "stat "+target, func() error { return unix.Stat(target, &st) })
	stale := mount.IsCorruptedMnt(err) || isTimeout(err)
	if !stale {
		err = scope.call(ctx, "unmount "+target, func() error { return d.mounter.Unmount(target) })
		if err == nil {
			return nil
		}
		if !isTimeout(err) {
			return err
		}
	}
	logger.Info("Mount is stale or its unmount hangs; forcing it", "target", target, "reason", err)
	return d.forceUnmount(ctx, scope, target)
}

// forceUnmount is the last resort: umount -f (which aborts outstanding NFS requests) and,
// failing that, a lazy unmount (unmount.ForceThenLazy).
func (d *Driver) forceUnmount(ctx context.Context, scope *opScope, target string) error {
	var force func() error
	if fu, ok := d.mounter.(mount.MounterForceUnmounter); ok {
		force = func() error { return fu.UnmountWithForce(target, d.opts.OperationTimeout/2) }
	}
	_, err := unmount.ForceThenLazy(ctx, target, force, scope.timeout, min(d.opts.OperationTimeout, unmount.LazyTimeout),
		func(ctx context.Context, timeout time.Duration, what string, fn func() error) error {
			return scope.withTimeout(timeout).call(ctx, what, fn)
		})
	if err != nil {
		return fmt.Errorf("unmount of %s: %w", target, err)
	}
	return nil
}

func isTimeout(err error) bool {
	var te *timeoutError
	return errors.As(err, &te)
}

// withTimeout returns a view of the scope whose calls use a different timeout but are tracked
// and released together with the scope's.
func (s *opScope) withTimeout(t time.Duration) scopedCaller {
	return scopedCaller{s: s, timeout: t}
}

type scopedCaller struct {
	s       *opScope
	timeout time.Duration
}

func (c scopedCaller) call(ctx context.Context, what string, fn func() error) error {
	return runBounded(ctx, c.timeout, what, &c.s.pending, &c.s.late, fn)
}
