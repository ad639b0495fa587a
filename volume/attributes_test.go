package volume

import (
	"strings"
	"testing"
)

// An NFS volume's and a btrfs-limited local one's: TestVolumeAttributeFormats.
func TestAttributesRoundTrip(t *testing.T) {
	for _, a := range []Attributes{
		{Backend: BackendLocal, BasePath: "/var/lib/dirpv", Path: "a/b"},
		{Backend: BackendLocal, BasePath: "/var/lib/dirpv", Path: "a/b", Quota: "project/4242"},
	} {
		got, err := ParseAttributes(a.Map())
		if err != nil || got != a {
			t.Errorf("ParseAttributes(%v.Map()) = %v, %v", a, got, err)
		}
	}
	if got := (Attributes{Backend: BackendNFS, Server: "10.0.0.1", Share: "/srv/nfs", Path: "x/y"}).NFSSource(); got != "10.0.0.1:/srv/nfs/x/y" {
		t.Errorf("NFSSource = %q", got)
	}
	if got := (Attributes{Backend: BackendNFS, Server: "fd00::1", Share: "/srv", Path: "x"}).NFSSource(); got != "[fd00::1]:/srv/x" {
		t.Errorf("IPv6 NFSSource = %q", got)
	}
}

func TestParseAttributesRefuses(t *testing.T) {
	for name, m := range map[string]map[string]string{
		"unknown key":      {"backend": "local", "basePath": "/b", "path": "p", "pathh": "x"},
		"no backend":       {"basePath": "/b", "path": "p"},
		"bad backend":      {"backend": "ceph", "basePath": "/b", "path": "p"},
		"dotdot":           {"backend": "local", "basePath": "/b", "path": "../etc"},
		"absolute path":    {"backend": "local", "basePath": "/b", "path": "/etc"},
		"relative base":    {"backend": "local", "basePath": "b", "path": "p"},
		"unclean base":     {"backend": "local", "basePath": "/b/../etc", "path": "p"},
		"nfs no server":    {"backend": "nfs", "share": "/s", "path": "p"},
		"nfs server slash": {"backend": "nfs", "server": "a/b", "share": "/s", "path": "p"},
		"nfs server dash":  {"backend": "nfs", "server": "-oexec", "share": "/s", "path": "p"},
		"nfs with base":    {"backend": "nfs", "server": "s", "share": "/s", "basePath": "/b", "path": "p"},
		"local with share": {"backend": "local", "basePath": "/b", "share": "/s", "path": "p"},
		"empty path":       {"backend": "local", "basePath": "/b"},
		"bad quota":        {"backend": "local", "basePath": "/b", "path": "p", "quota": "project/0"},
		"nfs with quota":   {"backend": "nfs", "server": "s", "share": "/s", "path": "p", "quota": "project/1"},
	} {
		if _, err := ParseAttributes(m); err == nil {
			t.Errorf("%s: ParseAttributes(%v) succeeded", name, m)
		}
	}
	// kubelet adds pod info when podInfoOnMount is set.
	m := Attributes{Backend: BackendLocal, BasePath: "/b", Path: "p"}.Map()
	m["csi.storage.k8s.io/pod.name"] = "web-0"
	if _, err := ParseAttributes(m); err != nil {
		t.Errorf("kubelet's pod info refused: %v", err)
	}
}

func TestCleanRelPath(t *testing.T) {
	ok := []string{"a", "a/b", "ns-claim-pvc-123", "..a", "a..", "...", strings.Repeat("x", 255)}
	for _, p := range ok {
		if _, err := CleanRelPath(p); err != nil {
			t.Errorf("CleanRelPath(%q) = %v", p, err)
		}
	}
	bad := []string{"", "/", "/a", "a/", "a//b", ".", "..", "a/..", "./a", "a\x00", strings.Repeat("x", 256)}
	for _, p := range bad {
		if _, err := CleanRelPath(p); err == nil {
			t.Errorf("CleanRelPath(%q) succeeded", p)
		}
	}
}
