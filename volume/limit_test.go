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
// quota ID in its marker; a retry adopts it with the same ID; RemoveAll removes it (a btrfs
// subvolume) and the ID can be released.
func TestMkdirAllLimitedOnBtrfs(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	claim := Claim{UID: "uid-a", PVName: "pv-a"}
	created, id, err := r.MkdirAllLimited("ns/vol", Owner{Mode: 0o2770, UID: 1234, GID: 5678}, claim, 5<<20)
	if err != nil || !created || id.Kind != quota.Btrfs {
		t.Fatalf("MkdirAllLimited = %v, %v, %v; want created with a btrfs quota", created, id, err)
	}
	st, err := r.Stat("ns/vol")
	must(t, err)
	if st.Mode&0o7777 != 0o2770 || st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("volume mode %o owner %d:%d, want 2770 1234:5678", st.Mode&0o7777, st.Uid, st.Gid)
	}
	f, err := os.Open(filepath.Join(mnt, "ns/vol"))
	must(t, err)
	got, ok, err := VolumeQuota(int(f.Fd()))
	if err != nil || !ok || got != id {
		t.Errorf("VolumeQuota = %v, %v, %v; want %v from the marker", got, ok, err, id)
	}
	fs, _ := r.Quota()
	u, err := fs.Usage(int(f.Fd()), id)
	f.Close()
	if err != nil || u.LimitBytes != 5<<20 {
		t.Errorf("Usage = %+v, %v; want a limit of 5 MiB", u, err)
	}
	entries, _ := os.ReadDir(filepath.Join(mnt, "ns"))
	if len(entries) != 1 {
		t.Errorf("ns holds %d entries, want only the volume", len(entries))
	}

	created, again, err := r.MkdirAllLimited("ns/vol", Owner{Mode: 0o700}, claim, 5<<20)
	if err != nil || created || again != id {
		t.Errorf("retry = %v, %v, %v; want adopted with %v", created, again, err, id)
	}

	must(t, os.WriteFile(filepath.Join(mnt, "ns/vol/file"), []byte("data"), 0o644))
	if err := r.RemoveAll("ns/vol"); err != nil {
		t.Fatalf("RemoveAll of a limited volume: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(mnt, "ns/vol")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume still there after RemoveAll: %v", err)
	}
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

// TestMkdirAllLimitedAfterCrash: what a crash between setting the limit and renaming into
// place leaves (a limited, unmarked subvolume under the temporary name) is removed by the next
// attempt, which makes the volume in place with its own limit.
func TestMkdirAllLimitedAfterCrash(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	fs, err := r.Quota()
	must(t, err)
	claim := Claim{UID: "uid-a", PVName: "pv-a"}
	base, err := os.Open(mnt)
	must(t, err)
	defer base.Close()
	tmp := tempName(claim, "vol")
	must(t, fs.Mkdir(int(base.Fd()), tmp, 0o755))
	left, err := os.Open(filepath.Join(mnt, tmp))
	must(t, err)
	leftID, err := fs.SetLimit(int(left.Fd()), 1<<20)
	left.Close()
	must(t, err)
	created, id, err := r.MkdirAllLimited("vol", Owner{Mode: 0o755}, claim, 5<<20)
	if err != nil || !created || id == leftID {
		t.Fatalf("MkdirAllLimited after a crash = %v, %v, %v; want a new volume with its own quota (not %v)", created, id, err, leftID)
	}
	entries, _ := os.ReadDir(mnt)
	if len(entries) != 1 || entries[0].Name() != "vol" {
		t.Errorf("base holds %v, want only the volume", entries)
	}
	f, err := os.Open(filepath.Join(mnt, "vol"))
	must(t, err)
	defer f.Close()
	if u, err := fs.Usage(int(f.Fd()), id); err != nil || u.LimitBytes != 5<<20 {
		t.Errorf("new volume's quota: %+v, %v; want a 5 MiB limit", u, err)
	}
}

// TestResizeOnBtrfs: Resize raises the limit its marker names; growth beyond the base's free
// space is refused with the limit unchanged; a shrink leaves the limit; a symlink in the
// volume's place is refused. (Only for the marker's claim, and a volume without a limit only
// recorded: provisioner TestResizeLocalRaisesTheLimitOnItsNodeOnly, TestResizeUnlimitedIsRecorded.)
func TestResizeOnBtrfs(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	claim := Claim{UID: "uid-a", PVName: "pv-a"}
	_, id, err := r.MkdirAllLimited("ns/vol", Owner{Mode: 0o755, UID: -1, GID: -1}, claim, 4<<20)
	must(t, err)
	fs, _ := r.Quota()
	limit := func() uint64 {
		t.Helper()
		f, err := os.Open(filepath.Join(mnt, "ns/vol"))
		must(t, err)
		defer f.Close()
		u, err := fs.Usage(int(f.Fd()), id)
		must(t, err)
		return u.LimitBytes
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
}
