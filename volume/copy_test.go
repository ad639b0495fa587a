package volume

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// treeHash is framework.TreeHash of dir, failing the test on error.
func treeHash(t testing.TB, dir string) map[string]string {
	t.Helper()
	h, err := framework.TreeHash(dir)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// diffTrees fails the test if the trees described by want and got differ.
func diffTrees(t testing.TB, want, got map[string]string) {
	t.Helper()
	diffs := framework.DiffSnapshots(want, got)
	for i, d := range diffs {
		if i == 20 {
			t.Errorf("... %d differences in all", len(diffs))
			break
		}
		t.Errorf("copy differs from its source: %s", d)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// oldTime is a time no test run writes at, so that a copied time is told from a new one.
var oldTime = time.Date(2001, 2, 3, 4, 5, 6, 789, time.UTC)

// writeEveryKind fills dir with an entry of every kind the copy handles, with odd modes,
// owners, attributes and times; outside is a file outside the base the symlink "out" names.
func writeEveryKind(t testing.TB, dir, outside string) {
	t.Helper()
	p := func(rel string) string { return filepath.Join(dir, rel) }
	must(t, os.MkdirAll(p("a/b/c"), 0o755))
	must(t, os.WriteFile(p("a/b/c/file"), []byte("hello"), 0o644))
	must(t, os.WriteFile(p("empty"), nil, 0o640))
	must(t, os.Lchown(p("empty"), 4242, 2424))
	must(t, unix.Setxattr(p("empty"), "user.empty", []byte("an empty file's"), 0))
	f, err := os.Create(p("sparse"))
	must(t, err)
	_, err = f.WriteAt([]byte(strings.Repeat("x", 4096)), 0)
	must(t, err)
	_, err = f.WriteAt([]byte(strings.Repeat("y", 4096)), 8<<20)
	must(t, err)
	must(t, f.Truncate(16<<20))
	must(t, f.Close())
	must(t, os.WriteFile(p("setuid"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Lchown(p("setuid"), 1234, 4321))
	must(t, os.Chmod(p("setuid"), 0o4755|os.ModeSetuid))
	must(t, unix.Chmod(p("setuid"), 0o4755))
	must(t, os.Mkdir(p("sgid"), 0o755))
	must(t, os.Lchown(p("sgid"), 5, 6))
	must(t, unix.Chmod(p("sgid"), 0o2775))
	must(t, os.Mkdir(p("sticky"), 0o755))
	must(t, unix.Chmod(p("sticky"), 0o1777))
	must(t, os.Mkdir(p("ro"), 0o755))
	must(t, os.WriteFile(p("ro/inside"), []byte("ro"), 0o400))
	must(t, unix.Chmod(p("ro"), 0o500))
	must(t, os.Symlink("a/b/c/file", p("rel")))
	must(t, os.Symlink(outside, p("out")))
	must(t, os.Symlink("nowhere", p("dangling")))
	must(t, os.Lchown(p("dangling"), 77, 88))
	must(t, os.WriteFile(p("hl1"), []byte("linked"), 0o640))
	must(t, os.Link(p("hl1"), p("a/hl2")))
	must(t, os.Link(p("hl1"), p("a/b/hl3")))
	must(t, unix.Mkfifo(p("fifo"), 0o640))
	must(t, unix.Mknod(p("sock"), unix.S_IFSOCK|0o755, 0))
	must(t, unix.Mknod(p("null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(t, unix.Setxattr(p("a/b/c/file"), "user.color", []byte("blue"), 0))
	must(t, unix.Setxattr(p("a"), "trusted.t", []byte("dir attr"), 0))
	must(t, unix.Lsetxattr(p("rel"), "trusted.l", []byte("on a symlink"), 0))
	must(t, unix.Setxattr(p("fifo"), "trusted.f", []byte("on a fifo"), 0))
	must(t, unix.Setxattr(p("setuid"), "security.dirpvtest", []byte("sec"), 0))
	must(t, unix.Setxattr(dir, "user.root", []byte("on the root"), 0))
	// Times last, deepest first: making entries changes their directory's.
	for _, rel := range []string{"a/b/c/file", "empty", "sparse", "setuid", "ro/inside", "hl1", "fifo", "sock", "a/b/c", "a/b", "a", "sgid", "sticky", "ro", "."} {
		must(t, os.Chtimes(p(rel), oldTime, oldTime))
	}
	for _, rel := range []string{"rel", "out", "dangling"} {
		must(t, unix.Lutimes(p(rel), []unix.Timeval{unix.NsecToTimeval(oldTime.UnixNano()), unix.NsecToTimeval(oldTime.UnixNano())}))
	}
}

// copyBase is a base directory with a source volume "src" holding every kind of entry, and
// a file outside the base the source links to.
type copyBase struct {
	root    *Root
	base    string
	outside string
}

func newCopyBase(t *testing.T, dir string) *copyBase {
	t.Helper()
	b := &copyBase{base: filepath.Join(dir, "base"), outside: filepath.Join(dir, "outside")}
	must(t, os.MkdirAll(b.base, 0o755))
	must(t, os.WriteFile(b.outside, []byte("secret"), 0o600))
	must(t, os.Chtimes(b.outside, oldTime, oldTime))
	b.root = rootAt(t, b.base)
	mkVolume(t, b.root, "ns/src", Owner{Mode: 0o2750, UID: 1000, GID: 2000}, Claim{UID: "src-uid", PVName: "pv-src"})
	writeEveryKind(t, filepath.Join(b.base, "ns/src"), b.outside)
	return b
}

// expectedCopy is the source's hash without what a copy leaves out: device nodes.
func expectedCopy(t testing.TB, dir string) map[string]string {
	want := treeHash(t, dir)
	delete(want, "null")
	return want
}

// noTemp fails if a temporary volume is left in dir.
func noTemp(t testing.TB, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	must(t, err)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), tempPrefix) {
			t.Errorf("temporary directory %s left in %s", e.Name(), dir)
		}
	}
}

// srcRoot opens a Root on dir for the test's lifetime, with an empty source volume "src".
func srcRoot(t *testing.T, dir string) *Root {
	t.Helper()
	r := rootAt(t, dir)
	mkVolume(t, r, "src", Owner{Mode: 0o755}, Claim{UID: "src"})
	return r
}

// TestMkdirAllFromCopiesEveryKind: a copy holds the same tree as its source (names, kinds,
// modes, owners, contents, link targets, attributes, hard-link groups, times), holes stay
// holes, device nodes are left out, the symlink to a file outside is copied as a symlink and
// its target is never opened, and the copy is marked as the new claim's.
func TestMkdirAllFromCopiesEveryKind(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	src := filepath.Join(b.base, "ns/src")
	var before unix.Stat_t
	must(t, unix.Stat(b.outside, &before))
	want := expectedCopy(t, src)
	// Hashing read the source's files, which moved their access times.
	var srcFile unix.Stat_t
	must(t, unix.Lstat(filepath.Join(src, "a/b/c/file"), &srcFile))

	claim := Claim{UID: "copy-uid", PVName: "pv-copy"}
	created, id, stats, err := b.root.MkdirAllFrom(context.Background(), "ns/copy", claim, 0, Source{Root: b.root, Rel: "ns/src"})
	if err != nil || !created || id.Kind != "" {
		t.Fatalf("MkdirAllFrom = %v, %v, %v; want created without a limit", created, id, err)
	}
	dst := filepath.Join(b.base, "ns/copy")
	var file unix.Stat_t
	must(t, unix.Lstat(filepath.Join(dst, "a/b/c/file"), &file))
	if file.Atim != srcFile.Atim {
		t.Errorf("copied file's atime %v, want the source's %v", file.Atim, srcFile.Atim)
	}
	diffTrees(t, want, treeHash(t, dst))

	var sparse unix.Stat_t
	must(t, unix.Stat(filepath.Join(dst, "sparse"), &sparse))
	if sparse.Size != 16<<20 || sparse.Blocks*512 > 1<<20 {
		t.Errorf("sparse copy: size %d, %d bytes allocated; want 16 MiB with its holes (8 KiB of data)", sparse.Size, sparse.Blocks*512)
	}
	var after unix.Stat_t
	must(t, unix.Stat(b.outside, &after))
	if after.Atim != before.Atim || after.Mtim != before.Mtim {
		t.Errorf("the file outside the source was touched: atime %v -> %v", before.Atim, after.Atim)
	}
	if got, _ := os.ReadFile(b.outside); string(got) != "secret" {
		t.Errorf("the file outside the source now holds %q", got)
	}
	if target, err := os.Readlink(filepath.Join(dst, "out")); err != nil || target != b.outside {
		t.Errorf("out in the copy: %q, %v; want a symlink to %s", target, err, b.outside)
	}
	if owner, marked, err := b.root.VolumeOwner("ns/copy"); err != nil || !marked || owner != claim {
		t.Errorf("copy's marker names %+v (marked %v, %v), want %+v", owner, marked, err, claim)
	}
	wantStats := CopyStats{Dirs: 6, Files: 6, Symlinks: 3, HardLinks: 2, Special: 2, Bytes: 5 + 16<<20 + 10 + 2 + 6, SkippedDevices: 1}
	stats.Allocated, stats.Method = 0, ""
	if stats != wantStats {
		t.Errorf("stats %+v\nwant  %+v", stats, wantStats)
	}
	noTemp(t, filepath.Join(b.base, "ns"))

	// A retry adopts it, copying nothing.
	created, _, stats, err = b.root.MkdirAllFrom(context.Background(), "ns/copy", claim, 0, Source{Root: b.root, Rel: "ns/src"})
	if err != nil || created || stats.Files != 0 {
		t.Errorf("retry = %v, %+v, %v; want adopted, nothing copied", created, stats, err)
	}
	// Even once the source is gone (the claim cloned was deleted meanwhile).
	must(t, b.root.RemoveAll("ns/src"))
	created, _, _, err = b.root.MkdirAllFrom(context.Background(), "ns/copy", claim, 0, Source{Root: b.root, Rel: "ns/src"})
	if err != nil || created {
		t.Errorf("retry without the source = %v, %v; want adopted", created, err)
	}
}

// TestMkdirAllFromRefusesEscapes: a source reached through a symlink is refused, whether it
// leads outside the base or not, and a cancelled copy fails with the context's error; nothing
// is made.
func TestMkdirAllFromRefusesEscapes(t *testing.T) {
	dir := t.TempDir()
	b := newCopyBase(t, dir)
	must(t, os.Mkdir(filepath.Join(dir, "elsewhere"), 0o755))
	must(t, os.Symlink(filepath.Join(dir, "elsewhere"), filepath.Join(b.base, "ns/escape")))
	must(t, os.Symlink("src", filepath.Join(b.base, "ns/alias")))
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		rel  string
		ctx  context.Context
		want error
	}{
		{"ns/escape", context.Background(), nil}, {"ns/alias", context.Background(), nil},
		{"ns/../../elsewhere", context.Background(), nil}, {"ns/missing", context.Background(), nil},
		{"ns/src", cancelled, context.Canceled},
	} {
		_, _, _, err := b.root.MkdirAllFrom(tc.ctx, "ns/copy", Claim{UID: "u"}, 0, Source{Root: b.root, Rel: tc.rel})
		if err == nil || tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("copy from %s: %v, want an error (%v)", tc.rel, err, tc.want)
		}
		absent(t, filepath.Join(b.base, "ns/copy"), "copy from "+tc.rel+": a volume was made")
	}
	noTemp(t, filepath.Join(b.base, "ns"))
}

// TestMkdirAllFromDoesNotCrossMounts: a mount inside the source, of a directory or of a single
// file, stops the copy with ErrMountInSource; nothing is left, and what is mounted is not read.
func TestMkdirAllFromDoesNotCrossMounts(t *testing.T) {
	bindFile := func(data []byte) func(t *testing.T, mnt string) {
		return func(t *testing.T, mnt string) {
			secret := filepath.Join(t.TempDir(), "secret")
			must(t, os.WriteFile(secret, data, 0o600))
			must(t, unix.Setxattr(secret, "user.secret", []byte("outside"), 0))
			must(t, os.WriteFile(mnt, nil, 0o644))
			must(t, unix.Mount(secret, mnt, "", unix.MS_BIND, ""))
			t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
		}
	}
	for _, tc := range []struct {
		name  string
		mount func(t *testing.T, mnt string)
	}{
		{"directory", func(t *testing.T, mnt string) {
			must(t, os.Mkdir(mnt, 0o755))
			must(t, unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"))
			t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
			must(t, os.WriteFile(filepath.Join(mnt, "other"), []byte("another file system"), 0o644))
		}},
		{"file", bindFile([]byte("a file outside the source"))},
		{"empty file", bindFile(nil)}, // copied without being opened
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newCopyBase(t, t.TempDir())
			tc.mount(t, filepath.Join(b.base, "ns/src/a/mnt"))
			_, _, _, err := b.root.MkdirAllFrom(context.Background(), "ns/copy", Claim{UID: "u"}, 0, Source{Root: b.root, Rel: "ns/src"})
			if !errors.Is(err, ErrMountInSource) {
				t.Fatalf("copy across a mount: %v, want ErrMountInSource", err)
			}
			absent(t, filepath.Join(b.base, "ns/copy"), "a volume was made")
			noTemp(t, filepath.Join(b.base, "ns"))
		})
	}
}

// TestMkdirAllFromBigTrees: 100k files and a tree deeper than a descriptor per level would
// allow are copied, and then removed, with the process's descriptors limited to 64. A tenant
// controls what is inside its volume, depth and modes included: a removal that needed one
// descriptor per level would make Delete fail for good and, while it ran, starve every other
// operation of the process of descriptors; and root removes a directory whose permissions the
// tenant took away all the same.
func TestMkdirAllFromBigTrees(t *testing.T) {
	if testing.Short() {
		t.Skip("100k files")
	}
	// tmpfs: making 100k files on a disk takes longer than copying them.
	dir := mountTmpfs(t, "size=512m")
	r := srcRoot(t, dir)
	src := filepath.Join(dir, "src")
	for d := 0; d < 100; d++ {
		sub := filepath.Join(src, fmt.Sprintf("d%02d", d))
		must(t, os.Mkdir(sub, 0o755))
		for f := 0; f < 1000; f++ {
			must(t, os.WriteFile(filepath.Join(sub, fmt.Sprint(f)), nil, 0o644))
		}
	}
	deep := filepath.Join(src, "deep")
	for i := 0; i < 1500; i++ {
		deep = filepath.Join(deep, "d")
	}
	must(t, os.MkdirAll(deep, 0o755))
	must(t, os.WriteFile(filepath.Join(deep, "bottom"), []byte("deep"), 0o644))

	var lim unix.Rlimit
	must(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	low := lim
	low.Cur = 64
	must(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	start := time.Now()
	_, _, stats, err := r.MkdirAllFrom(context.Background(), "copy", Claim{UID: "copy"}, 0, Source{Root: r, Rel: "src"})
	must(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	if err != nil {
		t.Fatalf("copy with 64 descriptors: %v", err)
	}
	t.Logf("copied %d files and %d directories in %v", stats.Files, stats.Dirs, time.Since(start))
	if stats.Files != 100_001 || stats.Dirs != 100+1+1500 {
		t.Errorf("stats %+v, want 100001 files and 1601 directories", stats)
	}
	got, err := os.ReadFile(filepath.Join(dir, "copy", strings.TrimPrefix(deep, src), "bottom"))
	if err != nil || string(got) != "deep" {
		t.Errorf("deepest file in the copy: %q, %v", got, err)
	}
	n, _ := os.ReadDir(filepath.Join(dir, "copy/d42"))
	if len(n) != 1000 {
		t.Errorf("copy/d42 holds %d files, want 1000", len(n))
	}

	must(t, os.Chmod(filepath.Join(dir, "copy/deep/d"), 0))
	must(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	err = r.RemoveAll("copy")
	must(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	if err != nil {
		t.Fatalf("RemoveAll of the copy with 64 descriptors: %.300v", err)
	}
	absent(t, filepath.Join(dir, "copy"), "the copy after RemoveAll")
}

// TestMkdirAllFromSourceChanging: a source written while it is copied (files and directories
// made and removed all the time) is copied without error, and what was not touched is there.
func TestMkdirAllFromSourceChanging(t *testing.T) {
	dir := t.TempDir()
	r := srcRoot(t, dir)
	src := filepath.Join(dir, "src")
	for d := 0; d < 20; d++ {
		must(t, os.MkdirAll(filepath.Join(src, "stable", fmt.Sprint(d)), 0o755))
		for f := 0; f < 100; f++ {
			must(t, os.WriteFile(filepath.Join(src, "stable", fmt.Sprint(d), fmt.Sprint(f)), []byte("s"), 0o644))
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			d := filepath.Join(src, "churn", fmt.Sprint(i%7))
			os.MkdirAll(d, 0o755)
			os.WriteFile(filepath.Join(d, fmt.Sprint(i%13)), []byte(strings.Repeat("c", i%5000)), 0o644)
			os.Symlink("x", filepath.Join(d, fmt.Sprint("l", i%11)))
			if i%3 == 0 {
				os.RemoveAll(filepath.Join(src, "churn", fmt.Sprint((i+3)%7)))
			}
		}
	})
	for i := 0; i < 5; i++ {
		name := fmt.Sprint("copy", i)
		_, _, _, err := r.MkdirAllFrom(context.Background(), name, Claim{UID: name}, 0, Source{Root: r, Rel: "src"})
		if err != nil {
			t.Errorf("copy %d of a changing source: %v", i, err)
			continue
		}
		n, _ := os.ReadDir(filepath.Join(dir, name, "stable/13"))
		if len(n) != 100 {
			t.Errorf("copy %d: stable/13 holds %d files, want 100", i, len(n))
		}
	}
	close(stop)
	wg.Wait()
}

// TestMkdirAllFromFull: a copy that does not fit the new volume's limit fails saying so and
// leaves nothing, its limit released.
func TestMkdirAllFromFull(t *testing.T) {
	mnt := quotatest.Btrfs(t, true)
	r := rootAt(t, mnt)
	srcDir := t.TempDir() // another file system: a plain copy
	sr := srcRoot(t, srcDir)
	data := make([]byte, 8<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	must(t, os.WriteFile(filepath.Join(srcDir, "src/big"), data, 0o644))
	before := quotatest.Qgroups(t, mnt)
	_, _, _, err := r.MkdirAllFrom(context.Background(), "ns/copy", Claim{UID: "u"}, 2<<20, Source{Root: sr, Rel: "src"})
	if !errors.Is(err, unix.EDQUOT) && !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("copy of 8 MiB into 2 MiB: %v, want EDQUOT", err)
	}
	if !strings.Contains(err.Error(), "full") {
		t.Errorf("error does not say the volume is full: %v", err)
	}
	absent(t, filepath.Join(mnt, "ns/copy"), "a volume was made")
	noTemp(t, filepath.Join(mnt, "ns"))
	if after := quotatest.Qgroups(t, mnt); len(after) != len(before) {
		t.Errorf("qgroups %v after the failed copy, want %v", after, before)
	}
}

// TestMkdirAllFromIntoItsSource: a copy made inside its own source (a source that is not a
// volume) leaves itself out instead of copying itself without end.
func TestMkdirAllFromIntoItsSource(t *testing.T) {
	dir := t.TempDir()
	r := rootAt(t, dir)
	must(t, os.MkdirAll(filepath.Join(dir, "ns/data"), 0o755))
	must(t, os.WriteFile(filepath.Join(dir, "ns/data/f"), []byte("f"), 0o644))
	_, _, stats, err := r.MkdirAllFrom(context.Background(), "ns/copy", Claim{UID: "u"}, 0, Source{Root: r, Rel: "ns"})
	if err != nil {
		t.Fatal(err)
	}
	if stats.Dirs != 1 || stats.Files != 1 {
		t.Errorf("stats %+v, want only data/ and data/f copied", stats)
	}
	absent(t, filepath.Join(dir, "ns/copy/copy"), "the copy holds itself")
}
