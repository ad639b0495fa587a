package sanity

import (
	"context"
	"maps"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/mount-utils"
)

// nodeFront is the address the sanity suite uses as "the driver". It forwards every Identity
// and Node call unchanged to the real node plugin, with one exception: GetPluginCapabilities
// also lists CONTROLLER_SERVICE. The suite decides from the node endpoint's identity alone
// whether to run its end-to-end node specs ("Node Service should work" and "should be
// idempotent": create, publish, stats, unpublish, delete), and dirpv's node plugin rightly
// does not claim a controller; the controller calls themselves go to the test controller.
// It also notes the file system type of each mount a publish made, so that a run can show
// which kind of mount the suite exercised.
type nodeFront struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedNodeServer
	id   csi.IdentityClient
	node csi.NodeClient

	mu sync.Mutex
	// published counts successful publishes by the file system type seen at their target.
	published map[string]int
}

func newNodeFront(conn grpc.ClientConnInterface) *nodeFront {
	return &nodeFront{id: csi.NewIdentityClient(conn), node: csi.NewNodeClient(conn), published: map[string]int{}}
}

func (f *nodeFront) GetPluginInfo(ctx context.Context, r *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return f.id.GetPluginInfo(ctx, r)
}

func (f *nodeFront) GetPluginCapabilities(ctx context.Context, r *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	resp, err := f.id.GetPluginCapabilities(ctx, r)
	if err != nil {
		return nil, err
	}
	resp.Capabilities = append(resp.Capabilities, controllerServiceCap)
	return resp, nil
}

func (f *nodeFront) Probe(ctx context.Context, r *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return f.id.Probe(ctx, r)
}

func (f *nodeFront) NodeStageVolume(ctx context.Context, r *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	return f.node.NodeStageVolume(ctx, r)
}

func (f *nodeFront) NodeUnstageVolume(ctx context.Context, r *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	return f.node.NodeUnstageVolume(ctx, r)
}

func (f *nodeFront) NodePublishVolume(ctx context.Context, r *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	resp, err := f.node.NodePublishVolume(ctx, r)
	if err == nil {
		fsType := "no mount"
		if infos, ierr := mount.ParseMountInfo("/proc/self/mountinfo"); ierr == nil {
			for _, mi := range infos {
				if mi.MountPoint == r.GetTargetPath() {
					fsType = mi.FsType // the last, topmost mount there
				}
			}
		}
		f.mu.Lock()
		f.published[fsType]++
		f.mu.Unlock()
	}
	return resp, err
}

// publishedTypes returns the published counts by file system type.
func (f *nodeFront) publishedTypes() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.published)
}

func (f *nodeFront) NodeUnpublishVolume(ctx context.Context, r *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	return f.node.NodeUnpublishVolume(ctx, r)
}

func (f *nodeFront) NodeGetVolumeStats(ctx context.Context, r *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	return f.node.NodeGetVolumeStats(ctx, r)
}

func (f *nodeFront) NodeGetVolumeHealth(ctx context.Context, r *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	return f.node.NodeGetVolumeHealth(ctx, r)
}

func (f *nodeFront) NodeGetStorageHealth(ctx context.Context, r *csi.NodeGetStorageHealthRequest) (*csi.NodeGetStorageHealthResponse, error) {
	return f.node.NodeGetStorageHealth(ctx, r)
}

func (f *nodeFront) NodeExpandVolume(ctx context.Context, r *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	return f.node.NodeExpandVolume(ctx, r)
}

func (f *nodeFront) NodeGetCapabilities(ctx context.Context, r *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return f.node.NodeGetCapabilities(ctx, r)
}

func (f *nodeFront) NodeGetInfo(ctx context.Context, r *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return f.node.NodeGetInfo(ctx, r)
}
