// Package install tests dirpv installed the way users install it: the image imported into
// containerd and deploy/overlays/e2e-local applied to a real single-node cluster (test/cluster),
// so the controller and node plugin run as pods with the manifests' RBAC, probes and mounts.
package install

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/release"
)

const (
	timeout  = 2 * time.Minute
	basePath = "/var/lib/dirpv" // the kind overlay's dirpv-local class
	nodeSel  = "app.kubernetes.io/name=dirpv,app.kubernetes.io/component=node"
)

var (
	// auditLog records every request of dirpv's ServiceAccounts, for the RBAC test.
	auditLog string
	suite    *framework.Suite
	inst     *framework.Installation
	// rel is the release (make release's artifacts) that inst installed.
	rel *release.Release
)

func TestMain(m *testing.M) {
	os.Exit(framework.RunSuite(m, framework.SuiteOptions{
		Name:          "install",
		Cluster:       cluster.Options{WithNode: true, Logf: klog.Infof},
		BeforeCluster: beforeCluster,
	}, func(ctx context.Context, s *framework.Suite) error {
		suite = s
		var err error
		if inst, rel, err = framework.InstallRelease(ctx, suite.Cluster, filepath.Join(s.Work.Dir, "dist"), klog.Infof,
			"--quota-check-period="+quotaCheckPeriod.String()); err != nil {
			return fmt.Errorf("install dirpv's release: %w", err)
		}
		return nil
	}))
}

// beforeCluster makes the apiserver audit dirpv's ServiceAccounts into the workspace, and
// registers the removal of this suite's volumes.
func beforeCluster(s *framework.Suite, opts *cluster.Options) error {
	// Volumes of this suite's namespaces live in the host's /var/lib/dirpv, as for a user;
	// remove them once the cluster is gone (cleanups run last first), and the base too if
	// this suite created it.
	_, baseErr := os.Stat(basePath)
	s.Cleanups.Add(func() {
		leftovers, _ := filepath.Glob(filepath.Join(basePath, "install-*"))
		// Archives of claims of a class with onDelete archive (TestUpgradeFromRelease) that
		// went with their namespace after the test.
		archives, _ := filepath.Glob(filepath.Join(basePath, "archived-install-*"))
		leftovers = append(leftovers, archives...)
		for _, d := range leftovers {
			os.RemoveAll(d)
		}
		if os.IsNotExist(baseErr) {
			os.Remove(basePath)
		}
	})
	// Mounted before dirpv's node pod starts, which must see it (btrfsBase). Cleanups run
	// last first: it is unmounted before the leftovers above go, which then find only its
	// empty mount point.
	if err := s.MountBtrfs(btrfsBase, 3<<30, true); err != nil {
		return err
	}
	auditDir := filepath.Join(s.Work.Dir, "audit")
	if err := os.MkdirAll(auditDir, 0o755); err != nil {
		return fmt.Errorf("audit dir: %w", err)
	}
	auditArgs, err := auditPolicy(auditDir)
	if err != nil {
		return fmt.Errorf("audit policy: %w", err)
	}
	opts.APIServerArgs = append(opts.APIServerArgs, auditArgs...)
	return nil
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// volumeDir returns the host directory of a bound claim.
func volumeDir(t *testing.T, ns, name string) string {
	t.Helper()
	pv, err := framework.WaitForBoundPV(context.Background(), suite.Client, ns, name, timeout)
	must(t, err)
	a := pv.Spec.CSI.VolumeAttributes
	return filepath.Join(a["basePath"], a["path"])
}

func waitRunning(t *testing.T, ns, name string) {
	t.Helper()
	_, err := framework.WaitForPodPhase(context.Background(), suite.Client, ns, name, v1.PodRunning, timeout)
	must(t, err)
}

// readGrows waits until the file's size exceeds from, i.e. the pod is still writing through
// its mount.
func readGrows(t *testing.T, path string, from int64) int64 {
	t.Helper()
	var size int64
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		st, err := os.Stat(path)
		if err != nil {
			return false, err
		}
		size = st.Size()
		return size > from, fmt.Errorf("%s has %d bytes", path, size)
	})
	must(t, err)
	return size
}

// TestInstalledIsTheRelease: this suite runs what a user of the release runs, the release's
// kind manifest and image: every dirpv container names the image by the release index's
// digest and runs it (kubelet reports the image it started by that digest), on this amd64
// node the index's linux/amd64 image.
func TestInstalledIsTheRelease(t *testing.T) {
	ctx := context.Background()
	node, err := suite.Client.CoreV1().Nodes().Get(ctx, suite.Cluster.NodeName, metav1.GetOptions{})
	must(t, err)
	if a := node.Status.NodeInfo.Architecture; a != "amd64" {
		t.Errorf("node architecture %s", a)
	}
	if _, ok := rel.Image.Manifests["amd64"]; !ok {
		t.Errorf("the release's index has no linux/amd64 image: %v", rel.Image.Manifests)
	}
	pods, err := suite.Client.CoreV1().Pods("dirpv").List(ctx, metav1.ListOptions{})
	must(t, err)
	containers := 0
	for _, p := range pods.Items {
		for _, c := range p.Spec.Containers {
			if c.Image != rel.ImageRef {
				t.Errorf("pod %s container %s: image %s, want the release's %s", p.Name, c.Name, c.Image, rel.ImageRef)
			}
		}
		for _, st := range p.Status.ContainerStatuses {
			containers++
			if st.ImageID != rel.ImageRef {
				t.Errorf("pod %s container %s runs %s (%s), want the release's %s", p.Name, st.Name, st.ImageID, st.Image, rel.ImageRef)
			}
		}
	}
	if containers < 2 {
		t.Errorf("%d dirpv containers with a status, want the controller's and the node plugin's at least", containers)
	}
}

// nodePlugin returns the node plugin's pod, which must have its one container running.
func nodePlugin(ctx context.Context, t *testing.T) (*v1.Pod, v1.ContainerStatus) {
	t.Helper()
	pods, err := suite.Client.CoreV1().Pods("dirpv").List(ctx, metav1.ListOptions{LabelSelector: nodeSel})
	must(t, err)
	if len(pods.Items) != 1 || len(pods.Items[0].Status.ContainerStatuses) != 1 || pods.Items[0].Status.ContainerStatuses[0].State.Running == nil {
		t.Fatalf("want one node plugin pod with its container running, have %+v", pods.Items)
	}
	return &pods.Items[0], pods.Items[0].Status.ContainerStatuses[0]
}

// The node plugin, which provisions local volumes, is SIGKILLed (its container's process, as
// the kernel's OOM killer or a crash would end it) while 50 claims are being provisioned,
// mid-way: some PVs made, not all claims Bound, and three held claims with their directory
// made but no PV. kubelet restarts the container; the held claims' retried Provision adopts
// the directories the killed process made, every claim binds with exactly one PV, and no
// directory is orphaned.
func TestNodePluginKilledDuringProvisioning(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	const n = 50
	held := []string{"c-00", "c-01", "c-02"}
	unblock, err := framework.BlockPVCreation(ctx, suite.Client, ns, held)
	must(t, err)
	var once sync.Once
	lift := func() { once.Do(func() { must(t, unblock(ctx)) }) }
	t.Cleanup(lift)
	plugin, before := nodePlugin(ctx, t)

	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := framework.NewClaim(ns, fmt.Sprintf("c-%02d", i), "", framework.OnNode(suite.Cluster.NodeName))
			if _, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Create(ctx, c, metav1.CreateOptions{}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	mine := func(name string) bool { return strings.HasPrefix(name, ns+"-") }
	heldDirs := func() []string {
		var out []string
		for _, c := range held {
			m, _ := filepath.Glob(filepath.Join(basePath, ns+"-"+c+"-*"))
			out = append(out, m...)
		}
		return out
	}
	// Kill as soon as the held claims' directories are there and some PV is: the node plugin
	// makes PVs faster than kube-controller-manager binds them, so waiting for Bound claims
	// would find nearly all the work done.
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		pvs, err := suite.Client.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		made := heldDirs()
		anyPV := slices.ContainsFunc(pvs.Items, func(pv v1.PersistentVolume) bool {
			return pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns
		})
		return anyPV && len(made) == len(held), fmt.Errorf("PVs of %s made: %t, held claims' directories %v", ns, anyPV, made)
	})
	must(t, err)

	pid, err := suite.Cluster.ContainerPID(ctx, before.ContainerID)
	must(t, err)
	if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err != nil || !strings.Contains(string(cmd), "dirpv") {
		t.Fatalf("process %d of container %s is not dirpv: %q %v", pid, before.ContainerID, cmd, err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("SIGKILL node plugin process %d: %v", pid, err)
	}
	// Its directories and PVs are final once the process is gone, not when the signal is sent.
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
		return os.IsNotExist(err), fmt.Errorf("process %d still there (%v)", pid, err)
	})
	must(t, err)
	// kubelet may already be starting the container again; the held claims cannot be Bound
	// until lift, so the snapshot shows the kill mid-way whatever the new process did since.
	snap, err := framework.TakeKillSnapshot(ctx, suite.Client, ns, basePath, mine)
	must(t, err)
	t.Logf("killed node plugin process %d with %d of %d claims Bound, %d directories, %d PVs", pid, snap.Bound, n, len(snap.Dirs), len(snap.PVPaths))
	if len(snap.PVPaths) == 0 || snap.Bound >= n {
		t.Fatalf("the kill was not mid-way: %d PVs made and %d of %d claims Bound", len(snap.PVPaths), snap.Bound, n)
	}
	for _, c := range held {
		if !slices.ContainsFunc(snap.Names(), func(d string) bool { return strings.HasPrefix(d, ns+"-"+c+"-") }) {
			t.Fatalf("held claim %s had no directory at the kill: %v", c, snap.Names())
		}
	}
	lift()

	// The same pod, its container restarted by kubelet, not a new pod.
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		p, err := suite.Client.CoreV1().Pods("dirpv").Get(ctx, plugin.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if len(p.Status.ContainerStatuses) != 1 {
			return false, fmt.Errorf("container statuses %+v", p.Status.ContainerStatuses)
		}
		cs := p.Status.ContainerStatuses[0]
		return cs.RestartCount > before.RestartCount && cs.Ready && cs.ContainerID != before.ContainerID,
			fmt.Errorf("restartCount %d (was %d), ready %t, container %s", cs.RestartCount, before.RestartCount, cs.Ready, cs.ContainerID)
	})
	if err != nil {
		t.Fatalf("the node plugin container was not restarted: %v", err)
	}
	must(t, framework.WaitForClaimsBound(ctx, suite.Client, ns, n, 3*time.Minute))
	dirs, err := snap.Entries()
	must(t, err)
	problems, err := framework.CheckOnePVPerClaim(ctx, suite.Client, ns, dirs)
	must(t, err)
	adoption, err := snap.CheckAdopted(ctx, suite.Client, ns, held)
	must(t, err)
	for _, p := range append(problems, adoption...) {
		t.Error(p)
	}
}
