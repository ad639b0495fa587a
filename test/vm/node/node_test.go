package node_test

import (
	"context"
	"fmt"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm"
	"github.com/dirpv/dirpv/test/vm/node"
)

// installTimeout bounds dirpv's install from deploy/ until its node plugin has registered:
// two Go programs starting in the VM's emulation.
const installTimeout = 10 * time.Minute

var (
	suite     *framework.Suite
	guestNode *node.Node
	// stopErr is the guest node's stop, which runs in the suite's cleanup after the tests:
	// an agent that did not end cleanly fails the run.
	stopErr error
)

func TestMain(m *testing.M) {
	os.Exit(node.Main(m, func() int {
		code := framework.RunSuite(m, framework.SuiteOptions{
			Name:    "vmnode",
			Cluster: cluster.Options{Address: node.HostAddr, Logf: klog.Infof, ControllerManagerArgs: kcmArgs()},
		}, setup)
		if stopErr != nil {
			fmt.Fprintf(os.Stderr, "FAIL: %v\n", stopErr)
			code = 1
		}
		return code
	}))
}

// kcmArgs are kube-controller-manager's extra flags: test/bench's client limits when the run is
// make bench's NFS phase (TestBenchNFS), else none.
func kcmArgs() []string {
	if os.Getenv(benchEnv) != "" {
		return benchKCMArgs
	}
	return nil
}

// setup boots the guest and waits for its node, the control plane being the suite's.
func setup(ctx context.Context, s *framework.Suite) error {
	suite = s
	img, err := vm.Prepare(ctx, os.Stderr)
	if err != nil {
		return err
	}
	// The node imports dirpv's image as it starts, as a node with a registry would have pulled it.
	dirpvTar, dirpvImage, err := framework.BuildDirpvImage(ctx)
	if err != nil {
		return err
	}
	if guestNode, err = node.Start(ctx, node.Options{Cluster: s.Cluster, Image: img, Images: []string{dirpvTar}, NFS: true, Disks: true, Output: os.Stderr}); err != nil {
		return err
	}
	// Pods of suite.BusyboxPod run the busybox image the guest node imported.
	s.Cluster.BusyboxImage = cluster.BusyboxImage
	s.Cleanups.Add(func() {
		start := time.Now()
		_, stopErr = guestNode.Stop()
		fmt.Fprintf(os.Stderr, "VM node stopped in %s\n", time.Since(start).Round(time.Second))
	})
	fmt.Fprintf(os.Stderr, "VM node %s: guest booted in %s, node Ready %s after the guest's start\n",
		guestNode.Name, guestNode.Boot.Round(time.Second), guestNode.Ready.Round(time.Second))
	if _, err := framework.InstallImage(ctx, s.Cluster, dirpvImage, guestNode.Name, installTimeout, klog.Infof,
		"--quota-check-period="+quotaCheckPeriod.String()); err != nil {
		return fmt.Errorf("install dirpv: %w", err)
	}
	// The scheduler places a claim of a WaitForFirstConsumer class on the node only once
	// the node plugin has published the class's CSIStorageCapacity there; a pod that comes
	// first is retried on an event, or after minutes.
	return framework.Poll(ctx, installTimeout, func(ctx context.Context) (bool, error) {
		caps, err := s.Client.StorageV1().CSIStorageCapacities("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range caps.Items {
			if c.StorageClassName == "dirpv-local" && c.NodeTopology != nil && c.NodeTopology.MatchLabels["kubernetes.io/hostname"] == guestNode.Name {
				return true, nil
			}
		}
		return false, fmt.Errorf("no CSIStorageCapacity of dirpv-local for node %s among %d", guestNode.Name, len(caps.Items))
	})
}

// newNamespace is suite.NewNamespace once the namespace's default ServiceAccount exists: pods
// are refused until it does.
func newNamespace(ctx context.Context, t *testing.T) string {
	t.Helper()
	ns := suite.NewNamespace(t)
	if err := framework.Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
		_, err := suite.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, err
	}); err != nil {
		t.Fatal(err)
	}
	return ns
}

// createPods creates the pods.
func createPods(ctx context.Context, t *testing.T, pods ...*corev1.Pod) {
	t.Helper()
	for _, p := range pods {
		if _, err := suite.Client.CoreV1().Pods(p.Namespace).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// createPod creates a busybox pod on the guest node that runs script with claim at /data.
func createPod(ctx context.Context, t *testing.T, ns, name, claim, script string) {
	t.Helper()
	createPods(ctx, t, suite.BusyboxPod(ns, name, claim, script, false))
}

// podOutput waits up to timeout for the pod to succeed and returns its log.
func podOutput(ctx context.Context, t *testing.T, ns, name string, timeout time.Duration) string {
	t.Helper()
	if _, err := framework.WaitForPodPhase(ctx, suite.Client, ns, name, corev1.PodSucceeded, timeout); err != nil {
		t.Fatalf("%v\nlog: %s\nevents:%s", err, podLog(ctx, ns, name), framework.EventsOf(ctx, suite.Client, ns, "Pod", name))
	}
	return podLog(ctx, ns, name)
}

func podLog(ctx context.Context, ns, name string) string {
	b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
}

// waitForLog waits up to timeout until the running pod's log holds line, a whole line, and
// returns the log.
func waitForLog(ctx context.Context, t *testing.T, ns, name, line string, timeout time.Duration) string {
	t.Helper()
	var log string
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		b, err := suite.Client.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			return false, err
		}
		log = string(b)
		return regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(line) + `$`).MatchString(log), fmt.Errorf("no line %q in the log yet", line)
	})
	if err != nil {
		t.Fatalf("pod %s/%s: %v; log:\n%s\nevents:%s", ns, name, err, log, framework.EventsOf(ctx, suite.Client, ns, "Pod", name))
	}
	return log
}

// TestLocalClaimOnGuestDisk: dirpv installed from deploy/ serves a claim of its default class,
// dirpv-local, and the file the pod wrote is in the volume's directory on the node's own disk.
func TestLocalClaimOnGuestDisk(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ns := newNamespace(ctx, t)
	// No class: the default one. Small: the base is on the guest's root, whose upper layer is
	// a tmpfs of half the guest's memory.
	suite.CreateClaim(t, ns, "data", "", framework.Request("16Mi"))
	createPod(ctx, t, ns, "writer", "data", "echo written-in-the-vm > /data/f")
	podOutput(ctx, t, ns, "writer", 5*time.Minute)
	pv, err := framework.WaitForBoundPV(ctx, suite.Client, ns, "data", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if pv.Spec.StorageClassName != "dirpv-local" || pv.Spec.CSI == nil || pv.Spec.CSI.Driver != "dirpv.io" {
		t.Fatalf("PV %s: class %q, CSI %+v: want a dirpv.io volume of dirpv-local", pv.Name, pv.Spec.StorageClassName, pv.Spec.CSI)
	}
	attrs := pv.Spec.CSI.VolumeAttributes
	if attrs["basePath"] == "" || attrs["path"] == "" {
		t.Fatalf("PV %s volume attributes %v: no basePath or path", pv.Name, attrs)
	}
	onDisk := path.Join(attrs["basePath"], attrs["path"], "f")
	if out, err := guestNode.Exec(ctx, time.Minute, "cat", onDisk); err != nil || out != "written-in-the-vm\n" {
		t.Errorf("%s on the guest's disk: %q, %v: want what the pod wrote", onDisk, out, err)
	}
	// The guest's root is the host's under an overlay of the guest's own: nothing reaches
	// the host.
	if _, err := os.Stat(onDisk); !os.IsNotExist(err) {
		t.Errorf("the volume's file is on the host too: %v", err)
	}
}

// TestNFSClaimRWXOnGuestNode: a ReadWriteMany claim of an NFS class served by the guest's
// kernel NFS server, mounted by the node plugin for two pods that run at the same time, each
// of which sees the other's file; each pod's mount is an nfs4 mount of server:share/<volume
// dir> with the class's options, and the files are in the volume's directory on the server.
func TestNFSClaimRWXOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ns := newNamespace(ctx, t)
	// The export is the NFSv4 root: NFSv4 mounts it as server:/.
	share, options := "/", []string{"nfsvers=4.2", "hard"}
	class := suite.CreateClass(t, "nfs-v42-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": share},
		framework.Immediate, framework.MountOptions(options...))
	suite.CreateClaim(t, ns, "shared", class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	// Each pod writes its file, then waits (bounded) for the other's: both finish only if
	// they ran at the same time on the same volume. A bind mount keeps source, type and
	// options, so the pod's own mount table shows the node plugin's mount.
	names := []string{"a", "b"}
	for i, name := range names {
		createPod(ctx, t, ns, name, "shared", fmt.Sprintf(`echo %[1]s > /data/%[1]s
i=0; while [ ! -e /data/%[2]s ]; do i=$((i+1)); [ $i -le 600 ] || { echo "no file %[2]s"; exit 3; }; sleep 0.5; done
echo "saw: $(ls /data | tr '\n' ' ')"; echo "%[2]s holds: $(cat /data/%[2]s)"
grep ' /data ' /proc/self/mounts`, name, names[1-i]))
	}
	pv, err := framework.WaitForBoundPV(ctx, suite.Client, ns, "shared", 5*time.Minute)
	if err != nil {
		t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, suite.Client, ns, "PersistentVolumeClaim", "shared"))
	}
	dir := pv.Spec.CSI.VolumeAttributes["path"]
	if dir == "" {
		t.Fatalf("PV %s volume attributes %v: no path", pv.Name, pv.Spec.CSI.VolumeAttributes)
	}
	source := node.NFSAddr + ":" + path.Join(share, dir)
	for i, name := range names {
		other := names[1-i]
		log := podOutput(ctx, t, ns, name, 5*time.Minute)
		lines := strings.Split(strings.TrimSpace(log), "\n")
		if len(lines) != 3 || lines[0] != "saw: a b " || lines[1] != other+" holds: "+other {
			t.Errorf("pod %s log %q: want it to have seen files a and b, %s holding %q", name, log, other, other)
			continue
		}
		// <source> /data <type> <options> 0 0
		m := strings.Fields(lines[2])
		if len(m) < 4 || m[0] != source || m[1] != "/data" || m[2] != "nfs4" {
			t.Errorf("pod %s mount %q, want %s on /data of type nfs4", name, lines[2], source)
			continue
		}
		for _, want := range []string{"rw", "vers=4.2", "hard"} {
			if !slices.Contains(strings.Split(m[3], ","), want) {
				t.Errorf("pod %s mount options %s: no %s (class mountOptions %v)", name, m[3], want, options)
			}
		}
	}
	onServer := path.Join(node.NFSExportDir, dir)
	if out, err := guestNode.Exec(ctx, time.Minute, "sh", "-c", "cd "+onServer+" && ls | tr '\\n' ' ' && cat a b"); err != nil || out != "a b a\nb\n" {
		t.Errorf("%s on the server: %q, %v: want files a and b holding their names", onServer, out, err)
	}
}
