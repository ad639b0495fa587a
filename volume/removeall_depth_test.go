package volume

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// A tenant controls what is inside its volume, depth and modes included. RemoveAll must not
// need one open file per level: a tree deeper than the process's file limit would otherwise
// make Delete fail forever and, while it runs, starve every other operation of the node plugin
// or controller of file descriptors.
func TestRemoveAllDeepTreeUsesBoundedDescriptors(t *testing.T) {
	r, base := newRoot(t)
	const depth = 1200
	// Build the tree with relative mkdirs, as a pod would, so no path grows past PATH_MAX.
	fd, err := unix.Open(base, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	must(t, unix.Mkdirat(fd, "vol", 0o755))
	for i := 0; i < depth; i++ {
		next, err := unix.Openat(fd, map[bool]string{true: "vol", false: "d"}[i == 0], unix.O_RDONLY|unix.O_DIRECTORY, 0)
		must(t, err)
		unix.Close(fd)
		fd = next
		must(t, unix.Mkdirat(fd, "d", 0o755))
		if i%100 == 0 {
			must(t, os.WriteFile("/proc/self/fd/"+strconv.Itoa(fd)+"/f", []byte("x"), 0o644))
		}
	}
	unix.Close(fd)
	// A tenant may also take every permission off a directory: root removes it all the same.
	must(t, os.Chmod(filepath.Join(base, "vol/d"), 0))

	var old unix.Rlimit
	must(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &old))
	lim := old
	lim.Cur = 256
	must(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	err = r.RemoveAll("vol")
	if rerr := unix.Setrlimit(unix.RLIMIT_NOFILE, &old); rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil {
		msg := strings.ReplaceAll(err.Error(), "d/", "")
		t.Fatalf("RemoveAll of a %d-deep tree with 256 descriptors: %s", depth, msg[:min(300, len(msg))])
	}
	absent(t, filepath.Join(base, "vol"), "vol still exists")
}
