package sanity

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/csinode"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume"
)

// skipControllerSpecs names the suite's controller specs. They would test testController, which
// is scaffolding, not dirpv: dirpv has no CSI controller.
const skipControllerSpecs = `\[Controller Server\]`

const nodeID = "sanity-node"

func TestSanity(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the node plugin makes real bind mounts")
	}
	tmp := t.TempDir()
	t.Cleanup(func() { framework.DetachMountsUnder(tmp) })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)

	// The real node plugin, as production runs it (system mount(8), real bind mounts), allowed
	// the one base the test controller creates volumes in.
	base := filepath.Join(tmp, "base")
	bases, err := volume.NewAllowedBases([]string{base}, filepath.Join(tmp, "kubelet"))
	if err != nil {
		t.Fatal(err)
	}
	nodeSock := filepath.Join(tmp, "node.sock")
	driver, err := csinode.NewDriver(csinode.Options{
		DriverName: "dirpv.io", Version: "sanity", NodeID: nodeID,
		Endpoint: "unix://" + nodeSock, Mounter: mount.New(""),
		OperationTimeout: 30 * time.Second, LocalBases: bases,
	})
	if err != nil {
		t.Fatal(err)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- driver.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-runErr; err != nil {
			t.Errorf("node plugin Run: %v", err)
		}
	})
	waitReady(t, driver, runErr)

	nodeConn, err := grpc.NewClient("unix://"+nodeSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nodeConn.Close() })
	front := newNodeFront(nodeConn)
	frontSock := serve(t, filepath.Join(tmp, "front.sock"), func(s *grpc.Server) {
		csi.RegisterIdentityServer(s, front)
		csi.RegisterNodeServer(s, front)
	})

	if err := os.Mkdir(base, 0o755); err != nil {
		t.Fatal(err)
	}
	root, err := volume.OpenRoot(base)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { root.Close() })
	ctrl := &testController{root: root, nodeID: nodeID}
	ctrlSock := serve(t, filepath.Join(tmp, "controller.sock"), func(s *grpc.Server) {
		csi.RegisterIdentityServer(s, ctrl)
		csi.RegisterControllerServer(s, ctrl)
	})

	cfg := sanity.NewTestConfig()
	cfg.Address = "unix://" + frontSock
	cfg.ControllerAddress = "unix://" + ctrlSock
	cfg.TargetPath = filepath.Join(tmp, "csi-mount")
	cfg.StagingPath = filepath.Join(tmp, "csi-staging")
	cfg.IdempotentCount = 5
	// Sizes mean nothing to a directory; keep the suite from implying otherwise.
	cfg.TestVolumeSize = 0
	sc := sanity.GinkgoTest(&cfg)
	gomega.RegisterFailHandler(ginkgo.Fail)
	suiteConfig, reporterConfig := ginkgo.GinkgoConfiguration()
	suiteConfig.SkipStrings = append(suiteConfig.SkipStrings, skipControllerSpecs)
	ginkgo.RunSpecs(t, "dirpv CSI node plugin sanity", suiteConfig, reporterConfig)
	sc.Finalize()

	// The suite unpublished everything it published: nothing may stay mounted.
	left, err := framework.MountsUnder(tmp)
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("mounts left behind: %v", left)
	}
	entries, err := os.ReadDir(base)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) > 0 {
		t.Errorf("volume directories left behind: %d", len(entries))
	}
}

// serve starts a gRPC server on a unix socket for the rest of the test.
func serve(t *testing.T, sock string, register func(*grpc.Server)) string {
	t.Helper()
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	register(s)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return sock
}

func waitReady(t *testing.T, d *csinode.Driver, runErr <-chan error) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for d.Ready() != nil {
		select {
		case err := <-runErr:
			t.Fatalf("node plugin stopped: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("node plugin not ready: %v", d.Ready())
		}
		time.Sleep(10 * time.Millisecond) // poll interval
	}
}
