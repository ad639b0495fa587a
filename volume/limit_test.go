package volume

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/dirpv/dirpv/volume/quota"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// TestMkdirAllLimitedOnBtrfs: a limited volume appears in place already limited, with its
// quota ID in its marker; a retry adopts it with the same ID. Resize raises the limit its marker
// names; growth beyond the base's free space is refused with the limit unchanged; a shrink
// leaves the limit; a symlink in the volume's place is refused. RemoveAll removes the volume (a
// btrfs subvolume) and the ID can be released. (Resize only for the marker's claim, and a volume
// without a limit only recorded: provisioner TestResizeLocalRaisesTheLimitOnItsNodeOnly,
// TestResizeUnlimitedIsRecorded.)
func TestMkdirAllLimitedOnBtrfs(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	claim := Claim{UID: "uid-a", PVName: "pv-a"}
	created, id, err := r.MkdirAllLimited("ns/vol", Owner{Mode: 0o2770, UID: 1234, GID: 5678}, claim, 4<<20)
	if err != nil || !created || id.Kind != quota.Btrfs {
		t.Fatalf("MkdirAllLimited = %v, %v, %v; want created with a btrfs quota", created, id, err)
	}
	st, err := r.Stat("ns/vol")
	must(t, err)
	if st.Mode&0o7777 != 0o2770 || st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("volume mode %o owner %d:%d, want 2770 1234:5678", st.Mode&0o7777, st.Uid, st.Gid)
	}
	limit := func() uint64 {
		t.Helper()
		marked, u := limitOf(t, r, "ns/vol")
		if marked != id {
			t.Errorf("the volume's marker names %v, want %v", marked, id)
		}
		return u.LimitBytes
	}
	if got := limit(); got != 4<<20 {
		t.Errorf("limit %d, want 4 MiB", got)
	}
	if entries, _ := os.ReadDir(filepath.Join(mnt, "ns")); len(entries) != 1 {
		t.Errorf("ns holds %d entries, want only the volume", len(entries))
	}
	if created, again, err := r.MkdirAllLimited("ns/vol", Owner{Mode: 0o700}, claim, 4<<20); err != nil || created || again != id {
		t.Errorf("retry = %v, %v, %v; want adopted with %v", created, again, err, id)
	}

	avail, err := r.Available()
	must(t, err)
	if _, err := r.Resize("ns/vol", claim, 4<<20+avail+1<<20); !errors.Is(err, ErrNotEnoughSpace) {
		t.Errorf("Resize beyond the %d free bytes = %v, want ErrNotEnoughSpace", avail, err)
	}
	if got := limit(); got != 4<<20 {
		t.Errorf("limit after a refused resize is %d, want %d", got, 4<<20)
	}
	if limited, err := r.Resize("ns/vol", claim, 8<<20); err != nil || !limited {
		t.Fatalf("Resize to 8 MiB = %v, %v", limited, err)
	}
	if got := limit(); got != 8<<20 {
		t.Errorf("limit after resize is %d, want %d", got, 8<<20)
	}
	if limited, err := r.Resize("ns/vol", claim, 2<<20); err != nil || !limited || limit() != 8<<20 {
		t.Errorf("Resize to 2 MiB = %v, %v, limit %d; want the limit left at 8 MiB", limited, err, limit())
	}
	must(t, os.Symlink(filepath.Join(mnt, "ns/vol"), filepath.Join(mnt, "ns/link")))
	if _, err := r.Resize("ns/link", claim, 16<<20); !errors.Is(err, ErrNotDirectory) {
		t.Errorf("Resize through a symlink = %v, want ErrNotDirectory", err)
	}
	if got := limit(); got != 8<<20 {
		t.Errorf("limit after a resize through a symlink is %d, want %d", got, 8<<20)
	}

	must(t, os.WriteFile(filepath.Join(mnt, "ns/vol/file"), []byte("data"), 0o644))
	if err := r.RemoveAll("ns/vol"); err != nil {
		t.Fatalf("RemoveAll of a limited volume: %v", err)
	}
	absent(t, filepath.Join(mnt, "ns/vol"), "volume still there after RemoveAll")
	if err := r.ReleaseQuota(id); err != nil {
		t.Error(err)
	}
}

// TestMkdirAllLimitedRefusedWhereNotEnforceable: on a base that cannot enforce, nothing is
// made and the error says so.
func TestMkdirAllLimitedRefusedWhereNotEnforceable(t *testing.T) {
	base := t.TempDir()
	r := rootAt(t, base)
	_, _, err := r.MkdirAllLimited("vol", Owner{Mode: 0o755}, Claim{UID: "u", PVName: "p"}, 1<<20)
	if !errors.Is(err, quota.ErrNotEnforceable) {
		t.Fatalf("MkdirAllLimited on %s = %v, want ErrNotEnforceable", base, err)
	}
	if entries, _ := os.ReadDir(base); len(entries) != 0 {
		t.Errorf("base holds %d entries after a refusal", len(entries))
	}
}
