package volume

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWithinComparesComponents(t *testing.T) {
	for _, tc := range []struct {
		p, dir string
		want   bool
	}{
		{"/var/lib/dirpv", "/var/lib/dirpv", true},
		{"/var/lib/dirpv/a/b", "/var/lib/dirpv", true},
		{"/var/lib/dirpv/", "/var/lib/dirpv", true},
		{"/var/lib/dirpv2", "/var/lib/dirpv", false},
		{"/var/lib/dirpv2/x", "/var/lib/dirpv", false},
		{"/var/lib/dirpv/../kubelet", "/var/lib/dirpv", false},
		{"/var/lib", "/var/lib/dirpv", false},
		{"/anything", "/", true},
	} {
		if got := Within(tc.p, tc.dir); got != tc.want {
			t.Errorf("Within(%q, %q) = %v, want %v", tc.p, tc.dir, got, tc.want)
		}
	}
}

func TestNewAllowedBasesRefusesKubeletRoot(t *testing.T) {
	tmp := t.TempDir()
	kubelet := filepath.Join(tmp, "kubelet")
	must(t, os.MkdirAll(filepath.Join(kubelet, "pods"), 0o755))
	// A base that reaches kubelet's root through a symlink is refused too.
	link := filepath.Join(tmp, "innocent")
	must(t, os.Symlink(filepath.Join(kubelet, "pods"), link))
	for name, tc := range map[string]struct {
		bases []string
		want  string
	}{
		"kubelet root":         {[]string{kubelet}, "kubelet's root dir"},
		"beneath kubelet root": {[]string{kubelet + "/pods"}, "kubelet's root dir"},
		"unclean path inside":  {[]string{tmp + "/x/../kubelet/pods"}, "kubelet's root dir"},
		"symlink into it":      {[]string{link}, "kubelet's root dir"},
		"relative":             {[]string{"var/lib/dirpv"}, "absolute"},
		"slash":                {[]string{"/"}, "every directory"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewAllowedBases(tc.bases, kubelet)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error saying %q", err, tc.want)
			}
		})
	}
	if _, err := NewAllowedBases([]string{filepath.Join(tmp, "kubelet2")}, kubelet); err != nil {
		t.Errorf("a sibling named like kubelet's root: %v", err)
	}
}

func TestLocate(t *testing.T) {
	a, err := NewAllowedBases([]string{"/var/lib/dirpv", "/srv/dirpv", "/srv/dirpv/fast", "/var/lib"}, "/var/lib/kubelet")
	must(t, err)
	for _, tc := range []struct {
		basePath, rel, wantBase, wantRel string
	}{
		{"/var/lib/dirpv", "vol", "/var/lib/dirpv", "vol"},
		{"/var/lib/dirpv/team", "a/vol", "/var/lib/dirpv", "team/a/vol"},
		{"/srv/dirpv/fast", "vol", "/srv/dirpv/fast", "vol"}, // the deepest base
		{"/var/lib/dirpv2", "vol", "/var/lib", "dirpv2/vol"},
	} {
		base, rel, err := a.Locate(tc.basePath, tc.rel)
		if err != nil || base != tc.wantBase || rel != tc.wantRel {
			t.Errorf("Locate(%q, %q) = %q, %q, %v; want %q, %q", tc.basePath, tc.rel, base, rel, err, tc.wantBase, tc.wantRel)
		}
	}
	for _, tc := range []struct{ basePath, rel, want string }{
		{"/etc", "ssh", "not at or beneath a base path this node allows (/srv/dirpv, /srv/dirpv/fast, /var/lib, /var/lib/dirpv)"},
		{"/srv/dirpv2", "x", "--allowed-base-paths"},
		{"/var/lib/kubelet", "pods", "inside kubelet's root dir /var/lib/kubelet"},
		{"/var/lib", "kubelet", "inside kubelet's root dir /var/lib/kubelet"},
		{"/var/lib/kubelet/pods", "x", "inside kubelet's root dir"},
		{"/var", "lib", "not at or beneath"},
	} {
		_, _, err := a.Locate(tc.basePath, tc.rel)
		if !errors.Is(err, ErrBaseNotAllowed) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Locate(%q, %q): %v, want ErrBaseNotAllowed saying %q", tc.basePath, tc.rel, err, tc.want)
		}
	}
	// A base that contains kubelet's root (allowed, oddly) still never yields a directory that
	// contains it.
	wide, err := NewAllowedBases([]string{"/var"}, "/var/lib/kubelet")
	must(t, err)
	if _, _, err := wide.Locate("/var", "lib"); !errors.Is(err, ErrBaseNotAllowed) || !strings.Contains(err.Error(), "contains kubelet's root dir") {
		t.Errorf("a directory around kubelet's root: %v", err)
	}
	if _, _, err := (&AllowedBases{}).Locate("/var/lib/dirpv", "v"); !errors.Is(err, ErrBaseNotAllowed) || !strings.Contains(err.Error(), "(none)") {
		t.Errorf("no bases allowed: %v", err)
	}
}

func TestOpenSubRootFollowsNoSymlink(t *testing.T) {
	top := t.TempDir()
	outside := t.TempDir()
	root := rootAt(t, top)
	sub, err := root.OpenSubRoot("a/b", true)
	must(t, err)
	sub.Close()
	if fi, err := os.Stat(filepath.Join(top, "a/b")); err != nil || !fi.IsDir() {
		t.Fatalf("a/b not created: %v", err)
	}
	must(t, os.Symlink(outside, filepath.Join(top, "link")))
	for _, create := range []bool{false, true} {
		if _, err := root.OpenSubRoot("link/x", create); !errors.Is(err, ErrNotDirectory) {
			t.Errorf("create=%v through a symlink: %v, want ErrNotDirectory", create, err)
		}
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("created %v outside the root", entries)
	}
}
