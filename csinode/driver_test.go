package csinode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/util/wait"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/internal/metricstest"
	"github.com/dirpv/dirpv/volume"
)

// noLocalBases allows no local volume: for tests that publish none.
var noLocalBases, _ = volume.NewAllowedBases(nil, "/var/lib/kubelet")

// waitReady polls Ready until it succeeds or the deadline passes.
func waitReady(t *testing.T, d *Driver, runErr <-chan error) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 10*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		select {
		case err := <-runErr:
			return false, fmt.Errorf("Run returned early: %v", err)
		default:
			return d.Ready() == nil, nil
		}
	})
	if err != nil {
		t.Fatalf("driver not ready: %v (Ready: %v)", err, d.Ready())
	}
}

func dial(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	must(t, err)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestRunAndRegistration starts the driver as the node plugin runs and talks to it as kubelet
// does: the plugin watcher finds <registry>/dirpv.io-reg.sock, dials the CSI endpoint, and
// reports the result with NotifyRegistrationStatus; publishes through the endpoint are measured.
func TestRunAndRegistration(t *testing.T) {
	dir := t.TempDir()
	registry := filepath.Join(dir, "plugins_registry")
	csiSock := filepath.Join(dir, "plugins", "dirpv.io", "csi.sock")
	// A stale socket from a previous instance must not stop the new one.
	must(t, os.MkdirAll(filepath.Dir(csiSock), 0o750))
	stale, err := listenUnix(csiSock)
	must(t, err)
	stale.Close()
	d, err := NewDriver(Options{
		DriverName: "dirpv.io", Version: "v0.1.0", NodeID: "node-1",
		Endpoint: "unix://" + csiSock, RegistrationDir: registry,
		Mounter: mount.NewFakeMounter(nil), OperationTimeout: time.Second, LocalBases: noLocalBases,
	})
	must(t, err)
	metrics := prometheus.NewPedanticRegistry()
	metrics.MustRegister(d.Collectors()...)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- d.Run(ctx) }()
	waitReady(t, d, runErr)

	// What GetInfo answers, kubelet accepts: test/e2e's suite waits for kubelet to list
	// dirpv.io in the node's CSINode (framework.WaitForDriverRegistered).
	regSock := filepath.Join(registry, "dirpv.io-reg.sock")
	reg := registerapi.NewRegistrationClient(dial(t, regSock))
	conn := dial(t, csiSock)
	pi, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || pi.Name != "dirpv.io" || pi.VendorVersion != "v0.1.0" {
		t.Errorf("GetPluginInfo = %v, %v", pi, err)
	}
	ni, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil || ni.NodeId != "node-1" || ni.AccessibleTopology.GetSegments()[TopologyKey] != "node-1" {
		t.Errorf("NodeGetInfo = %v, %v", ni, err)
	}
	pr, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
	if err != nil || !pr.GetReady().GetValue() {
		t.Errorf("Probe = %v, %v", pr, err)
	}

	// Publish and unpublish calls made through the endpoint, as kubelet makes them, are counted
	// and timed by backend and result: a publish, a refused one, an unpublish.
	node := csi.NewNodeClient(conn)
	id, target := volume.Handle(volume.BackendNFS, "pvc-1"), filepath.Join(dir, "target")
	attrs := volume.Attributes{Backend: volume.BackendNFS, Server: "nfs.example", Share: "/export", Path: "v"}
	rwx := mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	_, err = node.NodePublishVolume(ctx, publishReq(id, target, attrs, rwx, false))
	must(t, err)
	_, err = node.NodePublishVolume(ctx, publishReq(id, target, attrs, &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}, AccessMode: rwx.AccessMode}, false))
	wantCode(t, err, codes.InvalidArgument)
	_, err = node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	must(t, err)
	for _, c := range []struct{ name, backend, result string }{
		{"dirpv_node_publish_duration_seconds", "nfs", "success"},
		{"dirpv_node_publish_duration_seconds", "nfs", "InvalidArgument"},
		{"dirpv_node_unpublish_duration_seconds", "nfs", "success"},
		// Identity and other Node calls are not publish calls.
		{"dirpv_node_publish_duration_seconds", "local", "success"},
	} {
		want := map[string]uint64{"nfs": 1, "local": 0}[c.backend]
		if n := metricstest.HistogramCount(t, metrics, c.name, map[string]string{"backend": c.backend, "result": c.result}); n != want {
			t.Errorf("%s{backend=%s,result=%s} counted %d calls, want %d", c.name, c.backend, c.result, n, want)
		}
	}

	// A rejection is logged; the plugin keeps serving so kubelet can retry.
	_, err = reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "test rejection"})
	must(t, err)
	_, err = reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true})
	must(t, err)
	if err := d.Ready(); err != nil {
		t.Errorf("not ready after registration: %v", err)
	}

	cancel()
	select {
	case err := <-runErr:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	for _, p := range []string{csiSock, regSock} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket %s left behind: %v", p, err)
		}
	}
	if d.Ready() == nil {
		t.Error("Ready after stop")
	}
}

func TestNewDriverValidates(t *testing.T) {
	// A regular file where the socket should be: Run replaces a stale socket
	// (TestRunAndRegistration starts over one), and nothing else, so it does not start.
	sock := filepath.Join(t.TempDir(), "csi.sock")
	must(t, os.WriteFile(sock, []byte("data"), 0o600))
	good := Options{DriverName: "dirpv.io", Version: "v", NodeID: "n", Endpoint: "unix://" + sock, LocalBases: noLocalBases}
	d, err := NewDriver(good)
	must(t, err)
	for name, mutate := range map[string]func(*Options){
		"bad name":         func(o *Options) { o.DriverName = "-dirpv" },
		"no version":       func(o *Options) { o.Version = "" },
		"no node":          func(o *Options) { o.NodeID = "" },
		"tcp endpoint":     func(o *Options) { o.Endpoint = "tcp://127.0.0.1:1" },
		"relative socket":  func(o *Options) { o.Endpoint = "unix://csi.sock" },
		"relative reg dir": func(o *Options) { o.RegistrationDir = "registry" },
		"negative timeout": func(o *Options) { o.OperationTimeout = -time.Second },
		"no local bases":   func(o *Options) { o.LocalBases = nil },
	} {
		o := good
		mutate(&o)
		if _, err := NewDriver(o); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := d.Run(context.Background()); err == nil {
		t.Fatal("Run replaced a regular file")
	}
	if b, _ := os.ReadFile(sock); string(b) != "data" {
		t.Error("regular file was touched")
	}
}
