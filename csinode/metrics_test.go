package csinode

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/internal/metricstest"
	"github.com/dirpv/dirpv/volume"
)

// Publish and unpublish calls made through the plugin's gRPC endpoint, as kubelet makes them,
// are counted and timed by backend and result: a real bind mount, its unmount, and a refused
// request.
func TestPublishMetrics(t *testing.T) {
	requireRoot(t)
	sock := filepath.Join(t.TempDir(), "csi.sock")
	base, attrs := localVolume(t, "vol")
	bases, err := volume.NewAllowedBases([]string{base}, "/var/lib/kubelet")
	must(t, err)
	d, err := NewDriver(Options{DriverName: "dirpv.io", Version: "test", NodeID: "node-1",
		Endpoint: "unix://" + sock, Mounter: mount.New(""), LocalBases: bases})
	must(t, err)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(d.Collectors()...)
	ctx, cancel := context.WithCancel(context.Background())
	runErr := make(chan error, 1)
	go func() { runErr <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-runErr
	})
	waitReady(t, d, runErr)
	node := csi.NewNodeClient(dial(t, sock))

	target := newTarget(t)
	id := volume.Handle(volume.BackendLocal, "pvc-1")
	rw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	_, err = node.NodePublishVolume(ctx, publishReq(id, target, attrs, rw, false))
	must(t, err)
	if !isMounted(t, target) {
		t.Fatal("publish mounted nothing")
	}
	_, err = node.NodePublishVolume(ctx, publishReq(id, target, attrs, &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: rw.AccessMode,
	}, false))
	wantCode(t, err, codes.InvalidArgument)
	_, err = node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	must(t, err)
	if isMounted(t, target) {
		t.Fatal("unpublish left the mount")
	}

	for _, c := range []struct {
		name, result string
	}{
		{"dirpv_node_publish_duration_seconds", "success"},
		{"dirpv_node_publish_duration_seconds", "InvalidArgument"},
		{"dirpv_node_unpublish_duration_seconds", "success"},
	} {
		if n := metricstest.HistogramCount(t, reg, c.name, map[string]string{"backend": "local", "result": c.result}); n != 1 {
			t.Errorf("%s{backend=local,result=%s} counted %d calls, want 1", c.name, c.result, n)
		}
	}
	// Identity and other Node calls are not publish calls.
	if n := metricstest.HistogramCount(t, reg, "dirpv_node_publish_duration_seconds", map[string]string{"backend": "nfs", "result": "success"}); n != 0 {
		t.Errorf("nfs publishes counted: %d, want 0", n)
	}
}
