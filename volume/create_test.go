package volume

import (
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// A volume gets exactly the class's mode and owner, whatever the umask; its parents stay
// root's. (A second MkdirAll leaves them as they are: TestMkdirAllAdoptsOnlyItsOwnClaimsDirectory.)
func TestMkdirAllSetsExactModeAndOwner(t *testing.T) {
	r, base := newRoot(t)
	old := unix.Umask(0o077)
	defer unix.Umask(old)

	created, err := r.MkdirAll("ns/vol", Owner{Mode: 0o2770, UID: 1234, GID: 5678}, claimA)
	if err != nil || !created {
		t.Fatalf("MkdirAll = %v, %v; want created", created, err)
	}
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(base, "ns/vol"), &st))
	if got := st.Mode & 0o7777; got != 0o2770 {
		t.Errorf("mode = %o, want 2770 despite umask 077", got)
	}
	if st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("owner = %d:%d, want 1234:5678", st.Uid, st.Gid)
	}
	must(t, unix.Stat(filepath.Join(base, "ns"), &st))
	if st.Uid != 0 {
		t.Errorf("parent owner = %d, want root: only the volume itself belongs to the class's uid", st.Uid)
	}
}
