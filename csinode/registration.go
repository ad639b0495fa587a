package csinode

import (
	"context"

	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// SupportedCSIVersions are the CSI versions the plugin tells kubelet it speaks.
var SupportedCSIVersions = []string{"1.0.0"}

// registrationServer answers kubelet's plugin watcher on the registration socket: kubelet
// sees the socket appear in its plugins_registry directory, calls GetInfo, dials the returned
// CSI endpoint (NodeGetInfo), and reports the outcome with NotifyRegistrationStatus.
type registrationServer struct {
	registerapi.UnimplementedRegistrationServer
	name     string
	endpoint string
}

func (d *Driver) newRegistrationServer() *registrationServer {
	ep := d.opts.KubeletEndpoint
	if ep == "" {
		ep = d.socketPath
	}
	return &registrationServer{name: d.opts.DriverName, endpoint: ep}
}

// GetInfo describes the plugin to kubelet.
func (s *registrationServer) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.name,
		Endpoint:          s.endpoint,
		SupportedVersions: SupportedCSIVersions,
	}, nil
}

// NotifyRegistrationStatus logs kubelet's verdict. A rejection is logged as an error but the
// plugin keeps serving: kubelet retries registration while the socket exists, and exiting
// would only turn a configuration problem into a crash loop.
func (s *registrationServer) NotifyRegistrationStatus(ctx context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	logger := klog.FromContext(ctx)
	if st.PluginRegistered {
		logger.Info("Kubelet registered the CSI plugin", "endpoint", s.endpoint)
	} else {
		logger.Error(nil, "Kubelet REJECTED the CSI plugin registration; still serving so that kubelet can retry",
			"reason", st.Error, "endpoint", s.endpoint)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}
