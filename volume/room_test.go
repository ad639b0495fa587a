package volume

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// mountTmpfs mounts a tmpfs with options (size=..., nr_inodes=...) on a new directory, for
// the test's lifetime, and returns the directory.
func mountTmpfs(t *testing.T, options string) string {
	t.Helper()
	dir := t.TempDir()
	must(t, unix.Mount("tmpfs", dir, "tmpfs", 0, options))
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// duBlocks is what du counts for dir: the blocks of every entry, links not followed.
func duBlocks(t *testing.T, dir string) uint64 {
	t.Helper()
	var sum uint64
	must(t, filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		sum += uint64(st.Blocks) * 512
		return nil
	}))
	return sum
}

// TestCheckRoomForCopy: Available is the base file system's free space. A copy is allowed
// while it holds the source's usage and the margin, refused with the figures once it does not;
// the walk that sizes the source counts what du counts, in directories of more names than one
// read returns. (A source bigger than the free space: provisioner TestCloneWithoutRoomWaits.)
func TestCheckRoomForCopy(t *testing.T) {
	dir := mountTmpfs(t, "size=48m")
	r := rootAt(t, dir)
	src := filepath.Join(dir, "src")
	must(t, os.MkdirAll(filepath.Join(src, "a/b/c"), 0o755))
	empty, err := r.Available()
	must(t, err)
	if empty > 48<<20 || empty < 47<<20 {
		t.Fatalf("Available of an empty 48 MiB tmpfs = %d", empty)
	}
	must(t, os.WriteFile(filepath.Join(src, "a/b/c/big"), make([]byte, 5<<20), 0o644))
	if now, err := r.Available(); err != nil || empty-now != 5<<20 {
		t.Errorf("Available dropped by %d (%v) after a 5 MiB write, want %d", empty-now, err, 5<<20)
	}
	many := filepath.Join(src, "many")
	must(t, os.Mkdir(many, 0o755))
	for i := range 3000 {
		must(t, os.WriteFile(filepath.Join(many, "file-with-a-long-name-"+strconv.Itoa(i)), []byte("x"), 0o644))
	}
	must(t, os.Symlink("/etc/passwd", filepath.Join(src, "link")))

	fd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	used, err := walkUsage(context.Background(), fd)
	unix.Close(fd)
	must(t, err)
	if want := duBlocks(t, src); used != want {
		t.Errorf("walkUsage = %d, du counts %d", used, want)
	}

	source := Source{Root: r, Rel: "src"}
	if err := r.CheckRoomForCopy(context.Background(), source, 0); err != nil {
		t.Errorf("a copy of %d bytes with room for it: %v", used, err)
	}
	free, err := r.Available()
	must(t, err)
	err = r.CheckRoomForCopy(context.Background(), source, free-used+1)
	var noRoom *NoRoomError
	if !errors.As(err, &noRoom) || !errors.Is(err, ErrNoRoomForCopy) || errors.Is(err, unix.ENOSPC) {
		t.Fatalf("a copy that leaves less than its margin: %v, want a *NoRoomError", err)
	}
	if noRoom.Need != free+1 || noRoom.Free != free {
		t.Errorf("NoRoomError %+v, want need %d, free %d", noRoom, free+1, free)
	}
}
