package kernel

import (
	"testing"

	"github.com/dirpv/dirpv/test/sanity"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
)

// TestSanityNFS runs csi-sanity's Identity and Node specs against the node plugin with NFS
// volumes: the test controller makes each volume's directory on the guest's kernel export
// (through its own kernel-client mount of it, with the provisioner's directory code), and the
// node plugin mounts server:/share/path through mount.nfs.
func TestSanityNFS(t *testing.T) {
	options := []string{"nfsvers=4.2"}
	_, share := exportFor(t, options, guest.NoRootSquash)
	root := openExport(t, share, options)
	sanity.Run(t, sanity.Config{Dir: t.TempDir(), Volumes: root, FSTypes: []string{"nfs4"},
		Attributes: func(rel string) volume.Attributes {
			return volume.Attributes{Backend: volume.BackendNFS, Server: guest.NFSAddr, Share: share, Path: rel}
		}})
}
