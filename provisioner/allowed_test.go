package provisioner

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/volume"
)

// A local class whose basePath the node does not allow gets a clear error (the lib puts it in
// the claim's ProvisioningFailed event) and nothing on disk: its directories could never be
// mounted by the node plugin, which checks the same list.
func TestLocalBaseMustBeAllowed(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	outside := t.TempDir()
	must(t, os.Symlink(outside, filepath.Join(f.base, "link")))
	for name, tc := range map[string]struct{ basePath, want string }{
		"outside":           {outside, "base path " + outside + " is not at or beneath a base path this node allows (" + f.base + "); to use it, add it to dirpv node's --allowed-base-paths"},
		"lookalike":         {f.base + "2", "base path " + f.base + "2 is not at or beneath"},
		"through a symlink": {filepath.Join(f.base, "link", "sub"), "symlinks are never followed"},
	} {
		t.Run(name, func(t *testing.T) {
			class := f.localClass(map[string]string{"basePath": tc.basePath})
			_, _, err := f.node.Provision(ctx, opts(class, claim("c")))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Provision: %v; want an error saying %q", err, tc.want)
			}
			if got := listTree(t, outside); len(got) != 0 {
				t.Errorf("created outside the allowed base: %v", got)
			}
			if _, err := os.Lstat(f.base + "2"); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("lookalike base created: %v", err)
			}
		})
	}

	// Beneath an allowed base is fine; the class's base is created on first use.
	class := f.localClass(map[string]string{"basePath": filepath.Join(f.base, "team", "a")})
	pv, _, err := f.node.Provision(ctx, opts(class, claim("ok")))
	must(t, err)
	if fi, err := os.Stat(filepath.Join(f.base, "team", "a", pv.Spec.CSI.VolumeAttributes[volume.AttrPath])); err != nil || !fi.IsDir() {
		t.Fatalf("volume directory beneath the allowed base: %v", err)
	}

	// A PV is written by whoever may create PVs: deleting one that names a directory outside
	// the allowed bases must not remove it.
	victim := filepath.Join(outside, "victim")
	must(t, os.Mkdir(victim, 0o755))
	forged := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "forged", Annotations: map[string]string{AnnNode: testNode, AnnOnDelete: "delete"}},
		Spec: v1.PersistentVolumeSpec{PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
			Driver: testDriver, VolumeHandle: "local:forged",
			VolumeAttributes: volume.Attributes{Backend: volume.BackendLocal, BasePath: outside, Path: "victim"}.Map(),
		}}},
	}
	if err := f.node.Delete(ctx, forged); !errors.Is(err, volume.ErrBaseNotAllowed) {
		t.Errorf("Delete of a PV outside the allowed bases: %v", err)
	}
	if _, err := os.Stat(victim); err != nil {
		t.Errorf("directory outside the allowed bases removed: %v", err)
	}
}
