package provisioner

import "testing"

// nfs-subdir's usual pattern names an annotation whose key holds a slash.
func TestPatternKeyWithSlash(t *testing.T) {
	p, err := parsePattern("${pvc.metadata.namespace}/${pvc.metadata.annotations['nfs.io/storage-path']}")
	must(t, err)
	vars := pathVars{namespace: "ns", pvcName: "c", pvName: "pvc-1", annotations: map[string]string{"nfs.io/storage-path": "data"}}
	if rel, err := p.expand(vars); err != nil || rel != "ns/data" {
		t.Errorf("expand = %q, %v; want ns/data", rel, err)
	}
	vars.annotations["nfs.io/storage-path"] = "a/b"
	if rel, err := p.expand(vars); err == nil {
		t.Errorf("a value with a slash expanded to %q, want it refused", rel)
	}
	if _, err := parsePattern("${pvc.metadata.name/x"); err == nil {
		t.Error(`"${pvc.metadata.name/x" parsed, want unterminated`)
	}
}
