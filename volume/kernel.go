package volume

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// MinKernel is the oldest Linux release whose system calls Root relies on: openat2 with
// RESOLVE_BENEATH (5.6) and statx reporting STATX_MNT_ID (5.8).
const MinKernel = "5.8"

// kernelCalls are the system calls CheckKernel probes, replaceable so that a test can play an
// older kernel.
type kernelCalls struct {
	openat2 func(dirfd int, path string, how *unix.OpenHow) (int, error)
	statx   func(dirfd int, path string, flags, mask int, stx *unix.Statx_t) error
	uname   func(*unix.Utsname) error
}

var realKernel = kernelCalls{openat2: unix.Openat2, statx: unix.Statx, uname: unix.Uname}

// CheckKernel fails unless the running kernel offers what Root needs. Without it every
// volume operation would fail one by one with ENOSYS, so a daemon calls this at startup and
// exits with a message naming the kernel instead.
func CheckKernel() error { return checkKernel(realKernel) }

func checkKernel(k kernelCalls) error {
	fd, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /: %w", err)
	}
	defer unix.Close(fd)
	sub, err := k.openat2(fd, ".", &unix.OpenHow{
		Flags:   uint64(unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: resolveBeneath,
	})
	if err != nil {
		return kernelError(k, "openat2 with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS", err)
	}
	defer unix.Close(sub)
	var stx unix.Statx_t
	if err := k.statx(sub, "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &stx); err != nil {
		return kernelError(k, "statx", err)
	}
	if stx.Mask&unix.STATX_MNT_ID == 0 {
		return kernelError(k, "statx", errors.New("STATX_MNT_ID not reported"))
	}
	return nil
}

func kernelError(k kernelCalls, call string, err error) error {
	release := "unknown"
	var u unix.Utsname
	if k.uname(&u) == nil {
		release = unix.ByteSliceToString(u.Release[:])
	}
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
		// The kernel has the call, but a seccomp profile or an LSM blocks it.
		return fmt.Errorf("kernel %s: %s is not permitted (%w): dirpv needs it; run dirpv without a seccomp profile or LSM that blocks it",
			release, call, err)
	}
	return fmt.Errorf("kernel %s is too old: dirpv needs Linux %s or newer (openat2 RESOLVE_BENEATH since 5.6, statx STATX_MNT_ID since 5.8): %s: %w",
		release, MinKernel, call, err)
}
