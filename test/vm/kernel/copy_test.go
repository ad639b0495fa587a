package kernel

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota"
)

// writeCopyTree fills dir with what a copy must keep and the guest's file systems can all
// hold: data, a sparse file, hard links, symlinks (one to outside), a FIFO, odd modes and
// owners, old times.
func writeCopyTree(t *testing.T, dir string) {
	t.Helper()
	p := func(rel string) string { return filepath.Join(dir, rel) }
	for _, err := range []error{
		os.MkdirAll(p("a/b"), 0o755),
		os.WriteFile(p("a/b/data"), []byte(strings.Repeat("data ", 200_000)), 0o644),
		os.WriteFile(p("small"), []byte("small"), 0o600),
		os.Link(p("small"), p("a/small-link")),
		os.Symlink("a/b/data", p("rel")),
		os.Symlink("/etc/hostname", p("out")),
		unix.Mkfifo(p("fifo"), 0o640),
		os.Lchown(p("a/b/data"), 1234, 5678),
		os.Chmod(p("a"), 0o2770|os.ModeSetgid),
	} {
		must(t, err)
	}
	f, err := os.Create(p("sparse"))
	must(t, err)
	if _, err := f.WriteAt([]byte("end"), 64<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	old := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	for _, rel := range []string{"a/b/data", "small", "sparse", "fifo", "a/b", "a", "."} {
		must(t, os.Chtimes(p(rel), old, old))
	}
}

func treeHash(t *testing.T, dir string) map[string]string {
	t.Helper()
	h, err := framework.TreeHash(dir)
	must(t, err)
	return h
}

func sameTree(t *testing.T, what string, want, got map[string]string) {
	t.Helper()
	for _, d := range framework.DiffSnapshots(want, got) {
		t.Errorf("%s differs from its source: %s", what, d)
	}
}

// TestCloneOnXFSReflink: on XFS (reflink on, mkfs.xfs's default) with project quotas, a
// limited clone of a limited volume clones every file's extents, has its own project and
// limit, and holds the same tree; a clone whose limit is smaller than what the source holds
// fails with ENOSPC (XFS's EDQUOT for projects; it charges shared extents to every project using them) and leaves
// nothing. A snapshot there is a reflinked copy, held under a limit of its own, and restores
// the same tree.
func TestCloneOnXFSReflink(t *testing.T) {
	mnt := quotaFS(t, "xfs")
	r, err := volume.OpenRoot(mnt)
	must(t, err)
	defer r.Close()
	_, srcID, err := r.MkdirAllLimited("ns/src", volume.Owner{Mode: 0o750, UID: 1000, GID: 1000}, volume.Claim{UID: "src"}, 128<<20)
	must(t, err)
	writeCopyTree(t, filepath.Join(mnt, "ns/src"))
	want := treeHash(t, filepath.Join(mnt, "ns/src"))
	ctx := context.Background()

	_, id, stats, err := r.MkdirAllFrom(ctx, "ns/clone", volume.Claim{UID: "clone"}, 32<<20, volume.Source{Root: r, Rel: "ns/src"})
	must(t, err)
	if stats.Method != volume.MethodReflink {
		t.Errorf("Method %q, want %q", stats.Method, volume.MethodReflink)
	}
	if id.Kind != quota.Project || id == srcID {
		t.Errorf("clone's quota %v, want a project of its own (the source's is %v)", id, srcID)
	}
	sameTree(t, "clone", want, treeHash(t, filepath.Join(mnt, "ns/clone")))
	fs, err := r.Quota()
	must(t, err)
	if u, err := fs.Usage(dirFd(t, filepath.Join(mnt, "ns/clone")), id); err != nil || u.LimitBytes != 32<<20 || u.UsedBytes < 900<<10 {
		t.Errorf("clone's usage %+v, %v; want a 32 MiB limit charged the data", u, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(mnt, "ns/clone/sparse"), &st); err != nil || st.Blocks*512 > 1<<20 {
		t.Errorf("clone's sparse file: %d bytes allocated (%v), want its hole kept", st.Blocks*512, err)
	}

	_, _, _, err = r.MkdirAllFrom(ctx, "ns/small", volume.Claim{UID: "small"}, 256<<10, volume.Source{Root: r, Rel: "ns/src"})
	if !errors.Is(err, unix.EDQUOT) && !errors.Is(err, unix.ENOSPC) {
		t.Errorf("clone of a 1 MiB source into 256 KiB: %v, want EDQUOT or ENOSPC (XFS's for a full project)", err)
	}
	if _, err := os.Lstat(filepath.Join(mnt, "ns/small")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused clone is in place: %v", err)
	}

	// A snapshot is held under a limit of its source's size: one the source does not fit is
	// refused and leaves nothing; one it fits gets a project of its own, released with it.
	_, err = r.Snapshot(ctx, "ns/src", "small", volume.SnapshotOptions{Limit: 256 << 10})
	if !errors.Is(err, unix.EDQUOT) && !errors.Is(err, unix.ENOSPC) {
		t.Errorf("snapshot of a 1 MiB source under 256 KiB: %v, want EDQUOT or ENOSPC", err)
	}
	if names, _ := os.ReadDir(filepath.Join(mnt, ".dirpv-snapshots")); len(names) != 0 {
		t.Errorf("the refused snapshot left %v", names)
	}
	info, err := r.Snapshot(ctx, "ns/src", "snap", volume.SnapshotOptions{Limit: 32 << 20})
	must(t, err)
	if info.Method != volume.MethodReflink {
		t.Errorf("snapshot Method %q, want %q", info.Method, volume.MethodReflink)
	}
	snapDir := filepath.Join(mnt, ".dirpv-snapshots/snap")
	snapID, ok, err := fs.IDOf(dirFd(t, snapDir), dirFd(t, filepath.Join(snapDir, "tree")))
	if err != nil || !ok || snapID.Kind != quota.Project || snapID == srcID || snapID == id {
		t.Errorf("snapshot's quota %v (%v, %v), want a project of its own", snapID, ok, err)
	} else if u, err := fs.Usage(dirFd(t, snapDir), snapID); err != nil || u.LimitBytes != 32<<20 {
		t.Errorf("snapshot's usage %+v, %v; want a 32 MiB limit", u, err)
	}
	if _, _, _, err := r.MkdirAllFrom(ctx, "ns/restored", volume.Claim{UID: "restored"}, 32<<20, r.SnapshotSource("snap")); err != nil {
		t.Fatal(err)
	}
	sameTree(t, "restored snapshot", want, treeHash(t, filepath.Join(mnt, "ns/restored")))
	must(t, r.DeleteSnapshot("snap"))
	if u, err := fs.Usage(dirFd(t, mnt), snapID); err != nil || u.LimitBytes != 0 {
		t.Errorf("deleted snapshot's project: %+v, %v; want its limit released", u, err)
	}
}

// TestCloneOverNFS: a volume is copied through the kernel NFS client, v3 and v4.2 (where
// copy_file_range is a server-side copy and holes are found by SEEK_DATA), into the same tree.
func TestCloneOverNFS(t *testing.T) {
	for _, vers := range []string{"nfsvers=3", "nfsvers=4.2"} {
		t.Run(vers, func(t *testing.T) {
			options := []string{vers}
			serverDir, share := exportFor(t, options, guest.NoRootSquash)
			must(t, os.Mkdir(filepath.Join(serverDir, "vol"), 0o755))
			writeCopyTree(t, filepath.Join(serverDir, "vol"))
			want := treeHash(t, filepath.Join(serverDir, "vol"))
			r := openExport(t, share, options)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			copies := nfsOpCounts(t, r.Path())["COPY"]
			_, _, stats, err := r.MkdirAllFrom(ctx, "clone", volume.Claim{UID: "clone"}, 0, volume.Source{Root: r, Rel: "vol"})
			if err != nil {
				t.Fatalf("copy over NFS: %v", err)
			}
			t.Logf("stats %+v", stats)
			// The data is copied by the server (NFSv4.2 COPY, what copy_file_range becomes),
			// not read to the client and written back: one COPY at least per file with data
			// (a/b/data, small, sparse's last extent).
			if n := nfsOpCounts(t, r.Path())["COPY"] - copies; vers == "nfsvers=4.2" && n < 3 {
				t.Errorf("%d NFSv4.2 COPY operations for the clone, want 3 or more: its data went through the client", n)
			}
			sameTree(t, "clone over NFS", want, treeHash(t, filepath.Join(serverDir, "clone")))
			if vers == "nfsvers=4.2" {
				var st unix.Stat_t
				if err := unix.Stat(filepath.Join(serverDir, "clone/sparse"), &st); err != nil || st.Blocks*512 > 1<<20 {
					t.Errorf("clone's sparse file on the server: %d bytes allocated (%v), want its hole kept", st.Blocks*512, err)
				}
			}
		})
	}
}

// TestCloneOverNFSRoundTrips: an NFSv4.2 clone of empty files owned by the user dirpv runs as
// sends each file's create and the calls that give it its mode and times, and no more: the
// source of an empty file is not opened (an OPEN and a CLOSE to the server each), and a chown
// that would change nothing is not sent (a SETATTR). Most files of many trees are empty, and
// over NFS a clone's time is its round trips.
func TestCloneOverNFSRoundTrips(t *testing.T) {
	options := []string{"nfsvers=4.2"}
	serverDir, share := exportFor(t, options, guest.NoRootSquash)
	const n = 40
	src := filepath.Join(serverDir, "vol")
	must(t, os.Mkdir(src, 0o755))
	for i := range n {
		must(t, os.WriteFile(filepath.Join(src, fmt.Sprintf("e%02d", i)), nil, 0o644))
	}
	want := treeHash(t, src)
	r := openExport(t, share, options)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	before := nfsOpCounts(t, r.Path())
	if _, _, _, err := r.MkdirAllFrom(ctx, "clone", volume.Claim{UID: "clone"}, 0, volume.Source{Root: r, Rel: "vol"}); err != nil {
		t.Fatalf("copy over NFS: %v", err)
	}
	ops := opsSince(before, nfsOpCounts(t, r.Path()))
	t.Logf("NFS operations of the clone of %d empty files: %v", n, ops)
	// Per file: an OPEN that creates it, and SETATTRs for the times an exclusive create
	// leaves, its mode and its times; a few more for the volume's directory and its owner
	// record. Opening each source would add n OPENs, a chown each n SETATTRs.
	if opens := ops["OPEN"] + ops["OPEN_NOATTR"]; opens > n+5 {
		t.Errorf("%d OPEN operations for %d empty files, want at most %d: the sources were opened", opens, n, n+5)
	}
	if sets := ops["SETATTR"]; sets > 3*n+10 {
		t.Errorf("%d SETATTR operations for %d empty files, want at most %d", sets, n, 3*n+10)
	}
	// Their NFSv4 ACLs are those of their modes, which the copies have once given the modes.
	if sets := ops["SETACL"]; sets != 0 {
		t.Errorf("%d SETACL operations for %d files whose ACLs say no more than their modes (%q), want none",
			sets, n, nfs4ACL(t, filepath.Join(r.Path(), "vol/e00")))
	}
	sameTree(t, "clone over NFS", want, treeHash(t, filepath.Join(serverDir, "clone")))
}

// TestCloneOverNFSKeepsACLs: a clone through the NFSv4.2 client has its source's NFSv4 ACLs
// (nfs4_setfacl, as a user sets them): entries naming a user on a file with data and on an
// empty file, and a directory's entries for what is made in it; a file with only its mode's
// ACL in that directory, which a new file there would not have, has it in the clone too.
func TestCloneOverNFSKeepsACLs(t *testing.T) {
	options := []string{"nfsvers=4.2"}
	serverDir, share := exportFor(t, options, guest.NoRootSquash)
	src := filepath.Join(serverDir, "vol")
	must(t, os.MkdirAll(filepath.Join(src, "inherits"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "data"), []byte("data"), 0o640))
	must(t, os.WriteFile(filepath.Join(src, "empty"), nil, 0o600))
	must(t, os.WriteFile(filepath.Join(src, "inherits/plain"), nil, 0o644))
	r := openExport(t, share, options)
	vol := filepath.Join(r.Path(), "vol")
	const user = "4321" // no id mapping with sec=sys: users are their numbers
	runCmd(t, "nfs4_setfacl", "-a", "A::"+user+":rw", filepath.Join(vol, "data"))
	runCmd(t, "nfs4_setfacl", "-a", "A::"+user+":r", filepath.Join(vol, "empty"))
	runCmd(t, "nfs4_setfacl", "-a", "A:fd:"+user+":rx", filepath.Join(vol, "inherits"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, _, _, err := r.MkdirAllFrom(ctx, "clone", volume.Claim{UID: "clone"}, 0, volume.Source{Root: r, Rel: "vol"}); err != nil {
		t.Fatalf("copy over NFS: %v", err)
	}
	for _, rel := range []string{".", "data", "empty", "inherits", "inherits/plain"} {
		want, got := nfs4ACL(t, filepath.Join(vol, rel)), nfs4ACL(t, filepath.Join(r.Path(), "clone", rel))
		if named := strings.Contains(want, ":"+user+":"); named != (rel == "data" || rel == "empty" || rel == "inherits") {
			t.Fatalf("source %s: ACL %q: the test set it wrong", rel, want)
		}
		if got != want {
			t.Errorf("clone's %s: NFSv4 ACL %q, want its source's %q", rel, got, want)
		}
	}
}

// nfs4ACL is the NFSv4 ACL of p on an NFSv4 mount, as nfs4_getfacl prints it, an entry a line.
func nfs4ACL(t *testing.T, p string) string {
	t.Helper()
	out, err := exec.Command("nfs4_getfacl", p).CombinedOutput()
	if err != nil {
		t.Fatalf("nfs4_getfacl %s: %v: %s", p, err, out)
	}
	var aces []string
	for _, l := range strings.Split(string(out), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			aces = append(aces, l)
		}
	}
	return strings.Join(aces, " ")
}

// nfsOpCounts is how many operations of each kind (COPY, READ...) the NFS mount at mnt has
// sent, from its per-op statistics in /proc/self/mountstats; none for an op the mount's
// version does not have.
func nfsOpCounts(t *testing.T, mnt string) map[string]int64 {
	t.Helper()
	ops := map[string]int64{}
	raw, err := os.ReadFile("/proc/self/mountstats")
	must(t, err)
	in, perOp, found := false, false, false
	for _, l := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(l, "device ") {
			in, perOp = strings.Contains(l, " mounted on "+mnt+" with fstype nfs"), false
			found = found || in
			continue
		}
		if in && strings.Contains(l, "per-op statistics") {
			perOp = true
			continue
		}
		// "OP: ops transmissions timeouts bytes-sent bytes-received queue rtt execute [errors]"
		if f := strings.Fields(l); perOp && len(f) >= 9 && strings.HasSuffix(f[0], ":") {
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatalf("mountstats of %s: %q: %v", mnt, l, err)
			}
			ops[strings.TrimSuffix(f[0], ":")] = n
		}
	}
	if !found {
		t.Fatalf("no NFS mount at %s in /proc/self/mountstats", mnt)
	}
	return ops
}

// opsSince is the operations of each kind sent since before (nfsOpCounts), those sent at all.
func opsSince(before, after map[string]int64) map[string]int64 {
	d := map[string]int64{}
	for op, n := range after {
		if n -= before[op]; n > 0 {
			d[op] = n
		}
	}
	return d
}
