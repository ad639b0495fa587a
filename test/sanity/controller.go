package sanity

import (
	"context"
	"errors"
	"os"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/dirpv/dirpv/csinode"
	"github.com/dirpv/dirpv/volume"
)

// testController is the TEST-ONLY CSI controller the sanity suite needs to create volumes
// before it exercises the node plugin (the suite has no node-only mode). It creates volumes as
// the provisioner does: a directory beneath a local base or an NFS export's mount, made through
// volume.Root, with the volume attributes as the volume context.
type testController struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	root   *volume.Root
	attrs  func(rel string) volume.Attributes
	nodeID string
}

func (c *testController) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: "dirpv.io", VendorVersion: "sanity-test-controller"}, nil
}

func (c *testController) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{controllerServiceCap}}, nil
}

func (c *testController) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

var controllerServiceCap = &csi.PluginCapability{Type: &csi.PluginCapability_Service_{
	Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE},
}}

func (c *testController) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: []*csi.ControllerServiceCapability{{
		Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{
			Type: csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		}},
	}}}, nil
}

// volumeRel maps a volume name or ID to its directory: one path component.
func volumeRel(s string) (string, error) {
	if strings.Contains(s, "/") {
		return "", errors.New("must be a single path component")
	}
	return volume.CleanRelPath(s)
}

func (c *testController) CreateVolume(_ context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	rel, err := volumeRel(req.GetName())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "name: %v", err)
	}
	// The volume's name stands in for a claim: CreateVolume of the same name adopts it.
	if _, err := c.root.MkdirAll(rel, volume.Owner{Mode: 0o777, UID: -1, GID: -1}, volume.Claim{UID: rel, PVName: rel}); err != nil {
		return nil, status.Errorf(codes.Internal, "create volume directory: %v", err)
	}
	attrs := c.attrs(rel)
	vol := &csi.Volume{
		VolumeId:      rel,
		CapacityBytes: req.GetCapacityRange().GetRequiredBytes(),
		VolumeContext: attrs.Map(),
	}
	if attrs.Backend == volume.BackendLocal { // NFS volumes are reachable from every node
		vol.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{csinode.TopologyKey: c.nodeID}}}
	}
	return &csi.CreateVolumeResponse{Volume: vol}, nil
}

func (c *testController) DeleteVolume(_ context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
	rel, err := volumeRel(req.GetVolumeId())
	if err != nil {
		return &csi.DeleteVolumeResponse{}, nil // no such volume can exist: deleting it succeeds
	}
	if err := c.root.RemoveAll(rel); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "delete volume directory: %v", err)
	}
	return &csi.DeleteVolumeResponse{}, nil
}
