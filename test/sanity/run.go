package sanity

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
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

// Config says where the suite's volumes live.
type Config struct {
	// Dir is an empty directory for sockets and the suite's target paths; no mount may stay
	// beneath it after the suite.
	Dir string
	// Volumes is where the test controller creates volume directories: a local base, or the
	// mount of an NFS export. None may be left in it after the suite.
	Volumes *volume.Root
	// Attributes is the volume context of the volume at rel in Volumes, as the provisioner
	// would write it into the PV.
	Attributes func(rel string) volume.Attributes
	// LocalBases are the node plugin's allowed local base paths.
	LocalBases []string
	// FSTypes are the file system types a published volume may have at its target ("nfs4",
	// or the local base's type for bind mounts); at least one publish must have happened.
	FSTypes []string
}

// Run runs the sanity suite's Identity and Node specs against the real node plugin (system
// mount(8), real mounts), with cfg's volumes. It may run once per test binary (ginkgo).
func Run(t *testing.T, cfg Config) {
	t.Helper()
	t.Cleanup(func() { framework.DetachMountsUnder(cfg.Dir) })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)

	bases, err := volume.NewAllowedBases(cfg.LocalBases, filepath.Join(cfg.Dir, "kubelet"))
	if err != nil {
		t.Fatal(err)
	}
	nodeSock := filepath.Join(cfg.Dir, "node.sock")
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
	frontSock := serve(t, filepath.Join(cfg.Dir, "front.sock"), func(s *grpc.Server) {
		csi.RegisterIdentityServer(s, front)
		csi.RegisterNodeServer(s, front)
	})
	ctrl := &testController{root: cfg.Volumes, attrs: cfg.Attributes, nodeID: nodeID}
	ctrlSock := serve(t, filepath.Join(cfg.Dir, "controller.sock"), func(s *grpc.Server) {
		csi.RegisterIdentityServer(s, ctrl)
		csi.RegisterControllerServer(s, ctrl)
	})

	sc := sanity.NewTestConfig()
	sc.Address = "unix://" + frontSock
	sc.ControllerAddress = "unix://" + ctrlSock
	sc.TargetPath = filepath.Join(cfg.Dir, "csi-mount")
	sc.StagingPath = filepath.Join(cfg.Dir, "csi-staging")
	sc.IdempotentCount = 5
	// Sizes mean nothing to a directory; keep the suite from implying otherwise.
	sc.TestVolumeSize = 0
	suite := sanity.GinkgoTest(&sc)
	gomega.RegisterFailHandler(ginkgo.Fail)
	suiteConfig, reporterConfig := ginkgo.GinkgoConfiguration()
	suiteConfig.SkipStrings = append(suiteConfig.SkipStrings, skipControllerSpecs)
	ginkgo.RunSpecs(t, "dirpv CSI node plugin sanity", suiteConfig, reporterConfig)
	suite.Finalize()

	// The suite published volumes of the kind meant, and unpublished everything it published:
	// nothing may stay mounted.
	types := front.publishedTypes()
	t.Logf("published volumes by file system type at the target: %v", types)
	if len(types) == 0 {
		t.Errorf("the suite published no volume")
	}
	for typ := range types {
		if !slices.Contains(cfg.FSTypes, typ) {
			t.Errorf("volumes were published as %q, want one of %v (all publishes: %v)", typ, cfg.FSTypes, types)
		}
	}
	if left, err := framework.MountsUnder(cfg.Dir); err != nil || len(left) > 0 {
		t.Errorf("mounts left behind: %v (%v)", left, err)
	}
	entries, err := os.ReadDir(cfg.Volumes.Path())
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	if len(left) > 0 {
		t.Errorf("left behind where volumes are made: %s", strings.Join(left, ", "))
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
	err := framework.Poll(context.Background(), 10*time.Second, func(context.Context) (bool, error) {
		select {
		case err := <-runErr:
			t.Fatalf("node plugin stopped: %v", err)
		default:
		}
		return d.Ready() == nil, d.Ready()
	})
	if err != nil {
		t.Fatalf("node plugin not ready: %v", err)
	}
}
