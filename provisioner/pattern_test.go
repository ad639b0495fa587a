package provisioner

import (
	"testing"

	"github.com/dirpv/dirpv/volume/export"
)

// nfs-subdir's usual pattern names an annotation whose key holds a slash; a value with a slash
// is refused, and so is every name of dirpv's own directories, written in the pattern or
// coming from the claim.
func TestPatternExpand(t *testing.T) {
	vars := pathVars{namespace: "ns", pvcName: "c", pvName: "pv",
		annotations: map[string]string{"nfs.io/storage-path": "data", "slash": "a/b", "dir": export.TrashDir}}
	for pat, want := range map[string]string{ // want "": refused
		"${pvc.metadata.namespace}/${pvc.metadata.annotations['nfs.io/storage-path']}": "ns/data",
		"${pvc.metadata.annotations['slash']}":                                         "",
		export.TrashDir:                                                                "",
		export.TrashDir + "/${pv.metadata.name}":                                       "",
		".dirpv-x-${pv.metadata.name}":                                                 "",
		"${pvc.metadata.annotations['dir']}":                                           "",
	} {
		p, err := parsePattern(pat)
		must(t, err)
		if got, err := p.expand(vars); got != want || (err == nil) != (want != "") {
			t.Errorf("expand(%q) = %q, %v; want %q", pat, got, err, want)
		}
	}
	if _, err := parsePattern("${pvc.metadata.name/x"); err == nil {
		t.Error(`"${pvc.metadata.name/x" parsed, want unterminated`)
	}
}
