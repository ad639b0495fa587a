package volume

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// projectOfPath is the project ID of the file or directory at p, read as FileProject does.
func projectOfPath(t *testing.T, p string) uint32 {
	t.Helper()
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	must(t, err)
	defer unix.Close(fd)
	id, err := quota.FileProject(fd)
	must(t, err)
	return id
}

// A tenant (UID 1000, no capability) of a volume in project 4242 on a real XFS file system
// moves files out of the project as SECURITY.md describes: one into project 0, one into a
// neighbour's project, and a directory's inherit flag cleared, so that a file it then makes
// there lands in project 0. FindEscapes with repair finds exactly those four, names one of them
// relative to the volume, and moves each back: afterwards every file and directory of the
// volume is in 4242, the directory inherits it again, and a second check finds nothing. What
// the volume's symlinks point at, a file outside the volume, is never touched. (The host kernel
// enforces no project quota; XFS keeps and changes project IDs all the same. The VM tier checks
// the limit itself.)
func TestFindEscapesMovesFilesBackIntoTheirProject(t *testing.T) {
	mnt := quotatest.XFS(t)
	r := rootAt(t, mnt)
	mkVolume(t, r, "ns/vol", Owner{Mode: 0o755, UID: 1000, GID: 1000}, claimA)
	// The volume as MkdirAllLimited makes it where quotas are on: its project on the directory,
	// inherited, and named by its marker.
	const project = 4242
	parent, err := r.openDir("ns", unix.O_PATH)
	must(t, err)
	defer unix.Close(parent)
	dir, err := r.openChild(parent, "vol", "ns/vol")
	must(t, err)
	if err := quota.MoveIntoProject(dir, project, true); err != nil {
		unix.Close(dir)
		t.Fatal(err)
	}
	err = r.writeMarker(parent, dir, claimA, quota.ID{Kind: quota.Project, Num: project}.String())
	unix.Close(dir)
	must(t, err)
	outside := filepath.Join(mnt, "outside")
	must(t, os.WriteFile(outside, []byte("not the volume's"), 0o644))
	vol := filepath.Join(mnt, "ns/vol")
	if out, err := asTenant(vol, `set -e
mkdir -p a/b keep
echo x > a/b/f; echo y > g; echo z > keep/h
ln -s ../../outside link; ln -s ../.. up; mkfifo fifo
chattr -p 0 a/b/f
chattr -p 77 g
chattr -P a
echo new > a/new
`); err != nil {
		t.Fatalf("tenant's moves: %v\n%s", err, out)
	}
	for p, want := range map[string]uint32{"a/b/f": 0, "g": 77, "a/new": 0, "keep/h": project} {
		if got := projectOfPath(t, filepath.Join(vol, p)); got != want {
			t.Fatalf("before the check %s is in project %d, want %d (the tenant's move)", p, got, want)
		}
	}

	v, err := r.OpenVolume("ns/vol")
	must(t, err)
	defer v.Close()
	e, err := v.FindEscapes(context.Background(), true)
	must(t, err)
	t.Logf("found %+v", e)
	escaped := []string{"a", "a/b/f", "a/new", "g"}
	if e.Kind != quota.Project || e.Found != len(escaped) || e.Repaired != len(escaped) || !slices.Contains(escaped, e.Example) {
		t.Errorf("FindEscapes = %+v; want %d found and repaired, the example one of %q", e, len(escaped), escaped)
	}
	// ".", a, a/b, keep, a/b/f, g, keep/h, a/new: no symlink, no FIFO.
	if e.Walked != 8 {
		t.Errorf("walked %d files and directories, want 8", e.Walked)
	}
	for _, p := range []string{".", "a", "a/b", "keep", "a/b/f", "g", "keep/h", "a/new"} {
		if got := projectOfPath(t, filepath.Join(vol, p)); got != project {
			t.Errorf("after the check %s is in project %d, want %d", p, got, project)
		}
	}
	if got := projectOfPath(t, outside); got != 0 {
		t.Errorf("the file outside the volume, a symlink's target, went into project %d", got)
	}
	if out, err := asTenant(vol, `echo again > a/again`); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if got := projectOfPath(t, filepath.Join(vol, "a/again")); got != project {
		t.Errorf("a file made in the repaired directory is in project %d, want %d: it inherits no more", got, project)
	}
	if e, err := v.FindEscapes(context.Background(), true); err != nil || e.Found != 0 {
		t.Errorf("second check: %+v, %v; want nothing found", e, err)
	}
}
