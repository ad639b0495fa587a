package volume

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestCopyMemoryBounded: a clone of a directory holding 200,000 names, 50,000 files of them
// with two names each, grows the heap by no more than a fixed bound: the copier reads the
// directory a batch at a time, and its hard-link table, full, makes further names files of
// their own rather than grow. It is `make bench`'s memory row (1,000,000 names, 200,000 hard
// links, 32 MiB above idle) at a fifth of the names, a quarter of the links and a quarter of
// the table, with a heap bound of 6 MiB.
func TestCopyMemoryBounded(t *testing.T) {
	const (
		plain, pairs = 100_000, 50_000
		bound        = 6 << 20
	)
	dir := mountTmpfs(t, "size=512m,nr_inodes=1m")
	base := filepath.Join(dir, "base")
	must(t, os.Mkdir(base, 0o755))
	r := srcRoot(t, base)
	big := filepath.Join(base, "src", "big")
	must(t, os.Mkdir(big, 0o755))
	dfd, err := unix.Open(big, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	for i := range plain + pairs {
		fd, err := unix.Openat(dfd, fmt.Sprintf("f%06d", i), unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
		must(t, err)
		unix.Close(fd)
	}
	// The second names after all the first ones (tmpfs lists a directory in the order its
	// names were made): the table must hold every pair at once.
	for i := plain; i < plain+pairs; i++ {
		must(t, unix.Linkat(dfd, fmt.Sprintf("f%06d", i), dfd, fmt.Sprintf("l%06d", i), 0))
	}
	unix.Close(dfd)

	defer func(n int) { linkTableBytes = n }(linkTableBytes)
	linkTableBytes = 1 << 20
	// A small GC target, so that the heap follows what is live rather than the garbage
	// between two collections.
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	idle := ms.HeapInuse
	peak := idle
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	})
	start := time.Now()
	_, _, stats, err := r.MkdirAllFrom(context.Background(), "clone", Claim{UID: "clone"}, 0, Source{Root: r, Rel: "src"})
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("copied %d names in %v: heap in use %.1f MiB idle, %.1f MiB at its peak; stats %+v",
		plain+2*pairs, time.Since(start).Round(time.Millisecond), float64(idle)/(1<<20), float64(peak)/(1<<20), stats)
	if grew := peak - idle; grew > bound {
		t.Errorf("the copy grew the heap by %.1f MiB, want at most %.1f MiB", float64(grew)/(1<<20), float64(bound)/(1<<20))
	}
	if stats.Files+stats.HardLinks != plain+2*pairs {
		t.Errorf("stats %+v: want %d files and links", stats, plain+2*pairs)
	}
	if stats.LinksNotKept == 0 {
		t.Errorf("every link was kept: the test did not fill the %d-byte link table", linkTableBytes)
	}
	// Every name is there, and a pair kept as a link is one inode.
	f, err := os.Open(filepath.Join(base, "clone", "big"))
	must(t, err)
	defer f.Close()
	names, err := f.Readdirnames(-1)
	must(t, err)
	if len(names) != plain+2*pairs {
		t.Errorf("the copy holds %d names, want %d", len(names), plain+2*pairs)
	}
	linked := 0
	for i := plain; i < plain+pairs; i++ {
		var a, b unix.Stat_t
		must(t, unix.Fstatat(int(f.Fd()), fmt.Sprintf("f%06d", i), &a, unix.AT_SYMLINK_NOFOLLOW))
		must(t, unix.Fstatat(int(f.Fd()), fmt.Sprintf("l%06d", i), &b, unix.AT_SYMLINK_NOFOLLOW))
		if a.Ino == b.Ino {
			linked++
		}
	}
	if int64(linked) != stats.HardLinks {
		t.Errorf("%d pairs share an inode in the copy, want %d (HardLinks)", linked, stats.HardLinks)
	}
}

// TestCopyWhereOffsetsAreLost: where a directory offset is valid only on the descriptor that
// read it (FUSE file systems), the copier, back up from a subdirectory on
// a new descriptor, reads the directory again from its start and skips what it copied: the
// copy is whole, each name once.
func TestCopyWhereOffsetsAreLost(t *testing.T) {
	b := newCopyBase(t, t.TempDir())
	src := filepath.Join(b.base, "ns/src")
	for d := range 4 {
		sub := filepath.Join(src, fmt.Sprintf("d%d", d))
		must(t, os.Mkdir(sub, 0o755))
		for i := range dirBatch + 200 {
			must(t, os.WriteFile(filepath.Join(src, fmt.Sprintf("f%d-%d", d, i)), nil, 0o644))
			if i%3 == 0 {
				must(t, os.WriteFile(filepath.Join(sub, fmt.Sprintf("g%d", i)), []byte("x"), 0o644))
			}
		}
	}
	want := expectedCopy(t, src)
	last, refused := -1, 0
	refuseOffset = func(fd int, off int64) bool {
		// Reads come from one goroutine: the copy's.
		lost := off != 0 && fd != last
		last = fd
		if lost {
			refused++
		}
		return lost
	}
	defer func() { refuseOffset = nil }()
	_, _, stats, err := b.root.MkdirAllFrom(context.Background(), "ns/clone", Claim{UID: "clone"}, 0, Source{Root: b.root, Rel: "ns/src"})
	if err != nil {
		t.Fatal(err)
	}
	if refused == 0 {
		t.Fatal("no offset was refused: the test did not test anything")
	}
	diffTrees(t, want, treeHash(t, filepath.Join(b.base, "ns/clone")))
	if n := int64(len(want)) - 1; stats.Dirs+stats.Files+stats.Symlinks+stats.HardLinks+stats.Special != n {
		t.Errorf("stats %+v: want %d entries made, each once", stats, n)
	}
}

// TestMkdirAllFromCopiesFilesAtOnce: a copy makes several regular files at once, so that on a
// target where every call waits for a server (NFS) the waits of different files overlap, and
// still copies every file whole with its attributes.
func TestMkdirAllFromCopiesFilesAtOnce(t *testing.T) {
	dir := t.TempDir()
	r := srcRoot(t, dir)
	for i := range 32 {
		p := filepath.Join(dir, "src", fmt.Sprintf("f%02d", i))
		must(t, os.WriteFile(p, bytes.Repeat([]byte{byte(i)}, i*1000), 0o640))
		must(t, os.Chown(p, 1000+i, 2000))
		must(t, os.Chtimes(p, oldTime, oldTime))
	}
	want := treeHash(t, filepath.Join(dir, "src"))

	var mu sync.Mutex
	running, most := 0, 0
	overlap := make(chan struct{})
	// A copier that makes one file at a time never starts another while one waits: each
	// waits for the overlap until one shared deadline, then the rest go through at once.
	wait, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	copyFileStarted = func() {
		mu.Lock()
		running++
		if running > most {
			most = running
			if most == 2 {
				close(overlap)
			}
		}
		mu.Unlock()
		select {
		case <-overlap:
		case <-wait.Done():
		}
		mu.Lock()
		running--
		mu.Unlock()
	}
	t.Cleanup(func() { copyFileStarted = nil })

	_, _, stats, err := r.MkdirAllFrom(context.Background(), "copy", Claim{UID: "copy"}, 0, Source{Root: r, Rel: "src"})
	if err != nil {
		t.Fatal(err)
	}
	if most < 2 {
		t.Errorf("at most %d file copied at once, want 2 or more", most)
	}
	if stats.Files != 32 || stats.Bytes != 31*32/2*1000 {
		t.Errorf("stats %+v, want 32 files of %d bytes in all", stats, 31*32/2*1000)
	}
	diffTrees(t, want, treeHash(t, filepath.Join(dir, "copy")))
}

// TestMkdirAllFromEmptyFileReplaced: an empty file replaced, after the walk saw it, by a FIFO,
// a symlink or a directory is left out of the copy (Vanished), not made as an empty regular
// file: the copy of an empty file does not open its source, so it checks its kind by name.
func TestMkdirAllFromEmptyFileReplaced(t *testing.T) {
	dir := t.TempDir()
	r := rootAt(t, dir)
	t.Cleanup(func() { copyFileStarted = nil })
	for kind, replace := range map[string]func(string) error{
		"fifo":    func(p string) error { return unix.Mkfifo(p, 0o644) },
		"symlink": func(p string) error { return os.Symlink("/etc/hostname", p) },
		"dir":     func(p string) error { return os.Mkdir(p, 0o755) },
	} {
		src := "src-" + kind
		mkVolume(t, r, src, Owner{Mode: 0o755}, Claim{UID: src})
		e := filepath.Join(dir, src, "e")
		must(t, os.WriteFile(e, nil, 0o644))
		copyFileStarted = func() {
			must(t, os.Remove(e))
			must(t, replace(e))
		}
		_, _, stats, err := r.MkdirAllFrom(context.Background(), "copy-"+kind, Claim{UID: "copy-" + kind}, 0, Source{Root: r, Rel: src})
		must(t, err)
		if fi, err := os.Lstat(filepath.Join(dir, "copy-"+kind, "e")); err == nil {
			t.Errorf("%s: the copy holds a %v, want it left out: its source is no longer a regular file", kind, fi.Mode())
		}
		if stats.Vanished != 1 || stats.Files != 0 {
			t.Errorf("%s: stats %+v, want 1 vanished and no file", kind, stats)
		}
	}
}
