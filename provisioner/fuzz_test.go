package provisioner

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dirpv/dirpv/volume"
)

// FuzzPathStaysBeneathBase drives templates and hostile claim metadata through expansion and
// then through the real directory code, with a symlink planted in the base pointing outside it.
// Whatever the input, nothing may be created outside the base and no symlink may be followed.
// The seeds below and testdata/fuzz run as a normal test; `make fuzz` runs the campaign.
func FuzzPathStaysBeneathBase(f *testing.F) {
	for _, s := range [][5]string{
		{DefaultPathPattern, "ns", "claim", "app", "note"},
		{"${pvc.metadata.namespace}/${pvc.metadata.name}", "ns", "c", "", ""},
		{"${pvc.metadata.labels['k']}/${pvc.metadata.annotations['a']}", "ns", "c", "..", "../../etc"},
		{"${pvc.metadata.annotations['a']}", "ns", "c", "x", "/etc/passwd"},
		{"${pvc.metadata.annotations['a']}", "ns", "c", "x", "."},
		{"${pvc.metadata.annotations['a']}-x", "ns", "c", "x", "\x00"},
		{"link/${pvc.metadata.name}", "ns", "c", "x", "y"},
		{"${pvc.metadata.annotations['a']}/inner", "ns", "c", "x", "link"},
		{"a/${pvc.metadata.labels['k']}", "ns", "c", "\u2215etc", "\uff0e\uff0e"},
		{"${pvc.metadata.name}${pvc.metadata.name}", "ns", strings.Repeat("n", 200), "", ""},
	} {
		f.Add(s[0], s[1], s[2], s[3], s[4])
	}
	base := f.TempDir()
	outside := f.TempDir()
	if err := os.Symlink(outside, filepath.Join(base, "link")); err != nil {
		f.Fatal(err)
	}
	root, err := volume.OpenRoot(base)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { root.Close() })

	f.Fuzz(func(t *testing.T, pat, ns, name, label, annotation string) {
		p, err := parsePattern(pat)
		if err != nil {
			return
		}
		rel, err := p.expand(pathVars{namespace: ns, pvcName: name, pvName: "pvc-1",
			labels: map[string]string{"k": label}, annotations: map[string]string{"a": annotation}})
		if err != nil {
			return
		}
		full := filepath.Join(base, rel)
		if !strings.HasPrefix(full, base+"/") || filepath.Clean(full) != full {
			t.Fatalf("pattern %q expanded to %q, outside the base", pat, rel)
		}
		if _, err := volume.CleanRelPath(rel); err != nil {
			t.Fatalf("expansion %q is not a clean relative path: %v", rel, err)
		}
		_, mkErr := root.MkdirAll(rel, volume.Owner{Mode: 0o755, UID: -1, GID: -1}, volume.Claim{UID: "uid-1", PVName: "pvc-1"})
		if strings.HasPrefix(rel, "link/") && !errors.Is(mkErr, volume.ErrNotDirectory) {
			t.Fatalf("MkdirAll(%q) through the planted symlink: err %v", rel, mkErr)
		}
		if err := root.RemoveAll(rel); err != nil && !strings.HasPrefix(rel, "link/") {
			t.Fatalf("RemoveAll(%q): %v", rel, err)
		}
		if rel == "link" {
			// The only way to reach the planted link is to name it; it is then removed, not
			// followed. Put it back for the next input.
			if err := os.Symlink(outside, filepath.Join(base, "link")); err != nil && !os.IsExist(err) {
				t.Fatal(err)
			}
		}
		if entries, err := os.ReadDir(outside); err != nil || len(entries) != 0 {
			t.Fatalf("input %q reached outside the base: %v %v", rel, entries, err)
		}
	})
}
