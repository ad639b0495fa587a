// Package unmount takes down a mount that a plain unmount could not: one whose NFS server is
// dead, say, where umount(8) hangs in the kernel.
package unmount

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// LazyTimeout bounds a forced or lazy unmount, which do not wait for the server.
const LazyTimeout = 10 * time.Second

// Bound runs fn, a call that may block in the kernel, waiting for it at most timeout and no
// longer than ctx allows (blocking.Go); what names the call in its errors. Each caller brings
// its own, which accounts the call as its other calls on the mount are (slots, pending work).
type Bound func(ctx context.Context, timeout time.Duration, what string, fn func() error) error

// ForceThenLazy unmounts target with force (which aborts requests still waiting on a dead NFS
// server), bounded by forceTimeout, and failing that with MNT_DETACH, bounded by lazyTimeout,
// which takes the mount out of the tree at once and lets it go when its last user (an
// abandoned call, a handle still held) is done. A nil force skips the forced step. The lazy
// unmount is made even when ctx has ended: it is what keeps a dead server's mount from
// outliving its users. It returns which unmount took the mount away, "forced" or "lazy".
func ForceThenLazy(ctx context.Context, target string, force func() error, forceTimeout, lazyTimeout time.Duration, bound Bound) (how string, err error) {
	if force != nil {
		ferr := bound(ctx, forceTimeout, "forced unmount "+target, force)
		if done(ferr) {
			return "forced", nil
		}
		klog.FromContext(ctx).Info("Forced unmount failed; detaching lazily", "target", target, "reason", ferr)
		err = fmt.Errorf("forced unmount: %w", ferr)
	}
	lerr := bound(context.WithoutCancel(ctx), lazyTimeout, "lazy unmount "+target, func() error {
		return unix.Unmount(target, unix.MNT_DETACH)
	})
	if done(lerr) {
		return "lazy", nil
	}
	return "", errors.Join(err, fmt.Errorf("lazy unmount: %w", lerr))
}

// Force is the forced step of ForceThenLazy done with the syscall itself.
func Force(target string) func() error {
	return func() error { return unix.Unmount(target, unix.MNT_FORCE) }
}

// done reports whether an unmount step took the mount away. EINVAL: not a mount point any
// more, an earlier attempt got through after all.
func done(err error) bool { return err == nil || errors.Is(err, unix.EINVAL) }
