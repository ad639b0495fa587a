package framework

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"
)

// The export stand-in, through mount-utils as dirpv runs it (mount.New("") with the wrapper
// first on PATH): what the integration tier's NFS tests stand on.
func TestExportMountWrapper(t *testing.T) {
	w, err := NewWorkspace("dirpv-export-test-", NewCleanups(), false)
	must(t, err)
	t.Cleanup(func() { DetachMountsUnder(w.Dir); os.RemoveAll(w.Dir) })
	e, err := NewExport(w)
	must(t, err)
	t.Setenv("PATH", strings.TrimPrefix(e.Env()[0], "PATH="))
	must(t, os.MkdirAll(filepath.Join(e.ExportDir, "vol"), 0o777))
	must(t, os.WriteFile(filepath.Join(e.ExportDir, "vol", "f"), []byte("on the server"), 0o644))
	m := mount.New("")
	target := func(name string) string {
		d := filepath.Join(w.Dir, "mnt", name)
		must(t, os.MkdirAll(d, 0o755))
		return d
	}

	share, vol, ro := target("share"), target("vol"), target("ro")
	if err := m.Mount(e.Source(""), share, "nfs", []string{"nolock", "actimeo=2"}); err != nil {
		t.Fatalf("mount the share: %v", err)
	}
	if err := m.Mount(e.Source("vol"), vol, "nfs4", nil); err != nil {
		t.Fatalf("mount a directory of the share: %v", err)
	}
	if err := m.Mount(e.Source("vol"), ro, "nfs", []string{"hard", "ro"}); err != nil {
		t.Fatalf("mount read-only: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(vol, "f")); err != nil || string(b) != "on the server" {
		t.Errorf("file through the mount of vol: %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(share, "vol", "f")); err != nil {
		t.Errorf("file through the mount of the share: %v", err)
	}
	if err := os.WriteFile(filepath.Join(ro, "g"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write to the read-only mount: %v, want EROFS", err)
	}

	got, err := e.MountsUnder(filepath.Join(w.Dir, "mnt"))
	must(t, err)
	want := []ExportMount{
		{Dir: vol, FSType: "nfs4", Source: e.Source("vol")},
		{Dir: share, FSType: "nfs", Source: e.Source(""), Options: []string{"nolock", "actimeo=2"}},
		{Dir: ro, FSType: "nfs", Source: e.Source("vol"), Options: []string{"hard", "ro"}},
	}
	if !slices.EqualFunc(got, want, func(a, b ExportMount) bool {
		return a.Dir == b.Dir && a.FSType == b.FSType && a.Source == b.Source && slices.Equal(a.Options, b.Options)
	}) {
		t.Errorf("MountsUnder = %+v, want %+v", got, want)
	}

	// What is no NFS mount of the export goes to the system's mount(8), and fails as mount.nfs does.
	if err := m.Mount("other:/share", target("other"), "nfs", nil); err == nil || !strings.Contains(err.Error(), "no such export") {
		t.Errorf("mount of another server: %v, want refused", err)
	}
	if err := m.Mount(e.Source("")+"/../..", target("up"), "nfs", nil); err == nil || !strings.Contains(err.Error(), "not a clean path") {
		t.Errorf("mount of a path out of the export: %v, want refused", err)
	}
	bind := target("bind")
	if err := m.Mount(filepath.Join(e.ExportDir, "vol"), bind, "", []string{"bind"}); err != nil {
		t.Fatalf("bind mount through the wrapper: %v", err)
	}
	if _, err := os.Stat(filepath.Join(bind, "f")); err != nil {
		t.Errorf("file through the bind mount: %v", err)
	}
	for _, d := range []string{share, vol, ro, bind} {
		if err := m.Unmount(d); err != nil {
			t.Errorf("unmount %s: %v", d, err)
		}
	}
	if got, _ := MountsUnder(filepath.Join(w.Dir, "mnt")); len(got) != 0 {
		t.Errorf("mounts left: %v", got)
	}
}
