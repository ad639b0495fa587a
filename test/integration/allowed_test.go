package integration

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/dirpv/dirpv/test/framework"
)

// mountRWO is the capability kubelet publishes a ReadWriteOnce volume with.
var mountRWO = &csi.VolumeCapability{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}

// nodeAClient dials node-a's CSI socket, as kubelet would.
func nodeAClient(t *testing.T) csi.NodeClient {
	t.Helper()
	conn, err := grpc.NewClient(flagOf(t, nodeProc, "--csi-endpoint"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	return csi.NewNodeClient(conn)
}

// node-a runs with --allowed-base-paths set to the workspace's base root. A class whose
// basePath is elsewhere gets a claim event saying why and what to change, and no directory;
// a PV naming that directory is refused by the plugin, with nothing mounted.
func TestLocalClassOutsideAllowedBases(t *testing.T) {
	ns := suite.NewNamespace(t)
	outside := t.TempDir() // not under suite.Work.BaseRoot
	class := suite.CreateClass(t, "outside-allowed-bases", map[string]string{"backend": "local", "basePath": outside})
	suite.CreateClaim(t, ns, "c", class.Name, framework.OnNode(nodeA))
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "c", "ProvisioningFailed", "is not at or beneath a base path this node allows")
	for _, want := range []string{outside, suite.Work.BaseRoot, "--allowed-base-paths"} {
		if !strings.Contains(ev.Message, want) {
			t.Errorf("event %q does not say %q", ev.Message, want)
		}
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 0 {
		t.Errorf("created outside the allowed bases: %v", entries)
	}

	must(t, os.Mkdir(filepath.Join(outside, "vol"), 0o755))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	target := filepath.Join(t.TempDir(), "target")
	_, err := nodeAClient(t).NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: "local:outside", TargetPath: target, VolumeCapability: mountRWO,
		VolumeContext: map[string]string{"backend": "local", "basePath": outside, "path": "vol"},
	})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "--allowed-base-paths") {
		t.Errorf("publish outside the allowed bases: %v, want PermissionDenied naming --allowed-base-paths", err)
	}
	if _, err := os.Lstat(target); err == nil {
		t.Errorf("target %s created for a refused publish", target)
	}
}
