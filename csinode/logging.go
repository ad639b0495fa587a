package csinode

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// logInterceptor puts a logger carrying the method and volume ID into each call's context and
// logs every call's outcome: failures at V(0), successes at V(2). It logs selected fields
// only, never whole requests, so that the Secrets field of publish requests is never printed.
func logInterceptor(base klog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		logger := base.WithValues("method", info.FullMethod)
		if r, ok := req.(interface{ GetVolumeId() string }); ok && r.GetVolumeId() != "" {
			logger = logger.WithValues("volumeID", r.GetVolumeId())
		}
		if r, ok := req.(interface{ GetTargetPath() string }); ok && r.GetTargetPath() != "" {
			logger = logger.WithValues("targetPath", r.GetTargetPath())
		}
		start := time.Now()
		resp, err := handler(klog.NewContext(ctx, logger), req)
		code := status.Code(err)
		if err != nil {
			logger.Error(err, "CSI call failed", "code", code.String(), "duration", time.Since(start))
		} else {
			logger.V(2).Info("CSI call succeeded", "code", code.String(), "duration", time.Since(start))
		}
		return resp, err
	}
}
