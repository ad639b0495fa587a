package csinode

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// identityServer answers the CSI Identity service.
type identityServer struct {
	csi.UnimplementedIdentityServer
	d *Driver
}

// GetPluginInfo reports the driver name kubelet matches against PVs' spec.csi.driver.
func (s *identityServer) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.d.opts.DriverName, VendorVersion: s.d.opts.Version}, nil
}

// GetPluginCapabilities reports no CONTROLLER_SERVICE: dirpv's volumes are created by its
// external provisioner, not by a CSI controller. VOLUME_ACCESSIBILITY_CONSTRAINTS is true of
// local volumes, which exist on one node only (NodeGetInfo reports the topology segment).
func (s *identityServer) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
			Type: csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS,
		}},
	}}}, nil
}

// Probe reports readiness as Ready does.
func (s *identityServer) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(s.d.Ready() == nil)}, nil
}
