package volume

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// An older kernel (or a seccomp profile) is reported at startup with the kernel's release and
// the minimum, instead of as ENOSYS on every volume operation later.
func TestCheckKernelNamesReleaseAndMinimum(t *testing.T) {
	oldUname := func(u *unix.Utsname) error {
		copy(u.Release[:], "5.4.0-150-generic")
		return nil
	}
	noMntID := func(dirfd int, path string, flags, mask int, stx *unix.Statx_t) error {
		err := unix.Statx(dirfd, path, flags, mask, stx)
		stx.Mask &^= unix.STATX_MNT_ID // what 5.6 and 5.7 answer: success without the bit
		return err
	}
	failOpenat2 := func(errno unix.Errno) func(int, string, *unix.OpenHow) (int, error) {
		return func(int, string, *unix.OpenHow) (int, error) { return -1, errno }
	}
	for name, tc := range map[string]struct {
		calls kernelCalls
		want  []string
	}{
		"no openat2 (before 5.6)": {
			kernelCalls{openat2: failOpenat2(unix.ENOSYS), statx: unix.Statx, uname: oldUname},
			[]string{"kernel 5.4.0-150-generic is too old", "Linux 5.8 or newer", "openat2", "function not implemented"},
		},
		"no STATX_MNT_ID (5.6, 5.7)": {
			kernelCalls{openat2: unix.Openat2, statx: noMntID, uname: oldUname},
			[]string{"kernel 5.4.0-150-generic is too old", "Linux 5.8 or newer", "STATX_MNT_ID"},
		},
		"openat2 blocked by seccomp": {
			kernelCalls{openat2: failOpenat2(unix.EPERM), statx: unix.Statx, uname: oldUname},
			[]string{"kernel 5.4.0-150-generic", "openat2", "not permitted", "seccomp"},
		},
	} {
		t.Run(name, func(t *testing.T) {
			err := checkKernel(tc.calls)
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("message %q does not say %q", err, w)
				}
			}
		})
	}
}
