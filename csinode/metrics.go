package csinode

import (
	"context"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/dirpv/dirpv/volume"
)

// publishBuckets span a bind mount (milliseconds) to an NFS mount near the operation timeout.
var publishBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}

// metrics are the node plugin's own Prometheus metrics.
type metrics struct {
	publish, unpublish *prometheus.HistogramVec
}

func newMetrics() *metrics {
	vec := func(name, help string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: publishBuckets},
			[]string{"backend", "result"})
	}
	return &metrics{
		publish: vec("dirpv_node_publish_duration_seconds",
			"Time NodePublishVolume took, by backend (nfs, local, unknown) and result (success, or the gRPC code of the failure). Its _count is the number of calls."),
		unpublish: vec("dirpv_node_unpublish_duration_seconds",
			"Time NodeUnpublishVolume took, by backend (nfs, local, unknown, from the volume handle) and result (success, or the gRPC code of the failure). Its _count is the number of calls."),
	}
}

// Collectors returns the plugin's metrics, for the process's registry.
func (d *Driver) Collectors() []prometheus.Collector {
	return []prometheus.Collector{d.metrics.publish, d.metrics.unpublish}
}

// interceptor times publish and unpublish calls. The backend comes from the volume context on
// publish and from the handle on unpublish, which carries no context; either way it is one of
// a fixed set, and the result one of gRPC's codes, so the label set stays bounded.
func (m *metrics) interceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		var vec *prometheus.HistogramVec
		var backend string
		switch r := req.(type) {
		case *csi.NodePublishVolumeRequest:
			vec, backend = m.publish, volume.BackendLabel(volume.Backend(r.GetVolumeContext()[volume.AttrBackend]))
		case *csi.NodeUnpublishVolumeRequest:
			vec, backend = m.unpublish, volume.HandleBackendLabel(r.GetVolumeId())
		default:
			return handler(ctx, req)
		}
		start := time.Now()
		resp, err := handler(ctx, req)
		result := "success"
		if err != nil {
			result = status.Code(err).String()
		}
		vec.WithLabelValues(backend, result).Observe(time.Since(start).Seconds())
		return resp, err
	}
}
