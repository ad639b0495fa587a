package node_test

import (
	"context"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

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
	img       *vm.Image
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
	var err error
	if img, err = vm.Prepare(ctx, os.Stderr); err != nil {
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

// TestPodOnGuestNode: the node a user sees with `kubectl get node` is the guest, Ready, on the
// guest's kernel and address; a busybox pod runs to completion on it and another fails, and
// the log and exit status of each come back through the API (which reaches the guest's
// kubelet for the logs).
func TestPodOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cs := suite.Client
	nodes, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes.Items) != 1 || nodes.Items[0].Name != guestNode.Name {
		t.Fatalf("nodes: %v, want only %s", nodeNames(nodes.Items), guestNode.Name)
	}
	n := nodes.Items[0]
	if !ready(&n) {
		t.Errorf("node %s is not Ready: %v", n.Name, n.Status.Conditions)
	}
	if n.Status.NodeInfo.KernelVersion != img.Version {
		t.Errorf("node %s runs kernel %q, want the guest's %q", n.Name, n.Status.NodeInfo.KernelVersion, img.Version)
	}
	if !slices.Contains(n.Status.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: node.GuestAddr}) {
		t.Errorf("node %s addresses %v, want InternalIP %s", n.Name, n.Status.Addresses, node.GuestAddr)
	}

	ns := suite.NewNamespace(t)
	waitServiceAccount(ctx, t, ns)
	// The container's uname says which kernel it ran on; the scratch file that it writes
	// and reads back, that its root file system works.
	pods := []struct {
		name, script, log string
		phase             corev1.PodPhase
		exit              int32
	}{
		{"succeeds", "uname -r && echo written > /tmp/f && cat /tmp/f", img.Version + "\nwritten\n", corev1.PodSucceeded, 0},
		{"fails", "echo failing; exit 7", "failing\n", corev1.PodFailed, 7},
	}
	start := time.Now()
	for _, p := range pods {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Namespace: ns},
			Spec: corev1.PodSpec{
				RestartPolicy:                 corev1.RestartPolicyNever,
				TerminationGracePeriodSeconds: ptr.To[int64](1),
				Containers: []corev1.Container{{
					Name: "c", Image: cluster.BusyboxImage, ImagePullPolicy: corev1.PullNever,
					Command: []string{"sh", "-c", p.script},
				}},
			},
		}
		if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range pods {
		pod, err := framework.WaitForPodPhase(ctx, cs, ns, p.name, p.phase, 5*time.Minute)
		if err != nil {
			t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "Pod", p.name))
		}
		t.Logf("pod %s: create -> %s in %s", p.name, p.phase, time.Since(start).Round(time.Millisecond))
		if pod.Spec.NodeName != guestNode.Name {
			t.Errorf("pod %s ran on node %q, want %s", p.name, pod.Spec.NodeName, guestNode.Name)
		}
		if st := pod.Status.ContainerStatuses; len(st) != 1 || st[0].State.Terminated == nil || st[0].State.Terminated.ExitCode != p.exit {
			t.Errorf("pod %s container status %+v, want terminated with exit status %d", p.name, st, p.exit)
		}
		log, err := cs.CoreV1().Pods(ns).GetLogs(p.name, &corev1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			t.Errorf("log of pod %s through the API: %v", p.name, err)
		} else if string(log) != p.log {
			t.Errorf("log of pod %s = %q, want %q", p.name, log, p.log)
		}
	}
}

// TestLocalClaimOnGuestDisk: dirpv installed from deploy/ serves a claim of its default
// local class on the guest node; a pod writes to it, and the file is in the class's base
// directory on the guest's own disk, where a pod that mounts that directory directly reads it.
func TestLocalClaimOnGuestDisk(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cs := suite.Client
	ns := suite.NewNamespace(t)
	waitServiceAccount(ctx, t, ns)
	// No class: the default one, deploy/'s dirpv-local. Small: the base is on the guest's
	// root, whose upper layer is a tmpfs of half the guest's memory (CSIStorageCapacity ~1Gi).
	suite.CreateClaim(t, ns, "data", "", framework.Request("16Mi"))
	writer := suite.BusyboxPod(ns, "writer", "data", "echo written-in-the-vm > /data/f", false)
	writer.Spec.Containers[0].Image = cluster.BusyboxImage
	start := time.Now()
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, writer, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := framework.WaitForPodPhase(ctx, cs, ns, "writer", corev1.PodSucceeded, 5*time.Minute); err != nil {
		t.Fatalf("%v\nevents:%s%s", err, framework.EventsOf(ctx, cs, ns, "Pod", "writer"), framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "data"))
	}
	t.Logf("pod on a dirpv-local claim: create -> Succeeded in %s; events:%s", time.Since(start).Round(time.Millisecond),
		framework.EventsOf(ctx, cs, ns, "Pod", "writer"))
	pv, err := framework.WaitForBoundPV(ctx, cs, ns, "data", time.Minute)
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
	log := readOnGuest(ctx, t, ns, "reader", attrs["basePath"], "cat /host/"+attrs["path"]+"/f")
	if string(log) != "written-in-the-vm\n" {
		t.Errorf("%s/%s/f on the guest's disk holds %q, want what the pod wrote", attrs["basePath"], attrs["path"], log)
	}
	// The guest's root is the host's under an overlay of the guest's own: nothing reaches
	// the host.
	if _, err := os.Stat(filepath.Join(attrs["basePath"], attrs["path"])); !os.IsNotExist(err) {
		t.Errorf("the volume's directory is on the host too: %v", err)
	}
}

// TestNFSClaimRWXOnGuestNode: dirpv installed from deploy/ serves a ReadWriteMany claim of an
// NFS class from the guest's kernel NFS server: its controller (host network, in the guest)
// makes the volume's directory through its own mount of the export with the image's
// mount.nfs, and the node plugin mounts the volume's directory for two pods that run at the
// same time, each of which sees the other's file. The files are in the volume's directory on
// the server's exported directory, and each pod's mount is an nfs4 mount of
// server:share/<volume dir> with the class's options.
func TestNFSClaimRWXOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cs := suite.Client
	ns := suite.NewNamespace(t)
	waitServiceAccount(ctx, t, ns)
	// The export is the NFSv4 root: NFSv4 mounts it as server:/.
	share, options := "/", []string{"nfsvers=4.2", "hard"}
	class := suite.CreateClass(t, "nfs-v42-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": share},
		framework.Immediate, framework.MountOptions(options...))
	suite.CreateClaim(t, ns, "shared", class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	// Each pod writes its file, then waits (bounded) for the other's: both finish only if
	// they ran at the same time on the same volume. The pod's own mount table shows its
	// volume's mount as the node plugin made it (a bind mount keeps source, type and options).
	names := []string{"a", "b"}
	start := time.Now()
	for i, name := range names {
		other := names[1-i]
		script := fmt.Sprintf(`echo %[1]s > /data/%[1]s
i=0; while [ ! -e /data/%[2]s ]; do i=$((i+1)); [ $i -le 600 ] || { echo "no file %[2]s"; exit 3; }; sleep 0.5; done
echo "saw: $(ls /data | tr '\n' ' ')"; echo "%[2]s holds: $(cat /data/%[2]s)"
grep ' /data ' /proc/self/mounts`, name, other)
		pod := suite.BusyboxPod(ns, name, "shared", script, false)
		pod.Spec.Containers[0].Image = cluster.BusyboxImage
		if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	pv, err := framework.WaitForBoundPV(ctx, cs, ns, "shared", 5*time.Minute)
	if err != nil {
		t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "shared"))
	}
	attrs := pv.Spec.CSI.VolumeAttributes
	if attrs["path"] == "" {
		t.Fatalf("PV %s volume attributes %v: no path", pv.Name, attrs)
	}
	source := node.NFSAddr + ":" + path.Join(share, attrs["path"])
	for i, name := range names {
		other := names[1-i]
		pod, err := framework.WaitForPodPhase(ctx, cs, ns, name, corev1.PodSucceeded, 5*time.Minute)
		if err != nil {
			t.Fatalf("%v\nevents:%s%s", err, framework.EventsOf(ctx, cs, ns, "Pod", name), framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "shared"))
		}
		t.Logf("pod %s: create -> Succeeded in %s", name, time.Since(start).Round(time.Millisecond))
		if pod.Spec.NodeName != guestNode.Name {
			t.Errorf("pod %s ran on node %q, want %s", name, pod.Spec.NodeName, guestNode.Name)
		}
		b, err := cs.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			t.Fatalf("log of pod %s: %v", name, err)
		}
		log := string(b)
		t.Logf("pod %s log:\n%s", name, log)
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
		opts := strings.Split(m[3], ",")
		for _, want := range []string{"rw", "vers=4.2", "hard"} {
			if !slices.Contains(opts, want) {
				t.Errorf("pod %s mount options %s: no %s (class mountOptions %v)", name, m[3], want, options)
			}
		}
	}
	// The server's side: the volume's directory in the exported directory holds both files.
	b := readOnGuest(ctx, t, ns, "server", node.NFSExportDir, "cd /host/"+attrs["path"]+" && ls | tr '\\n' ' ' && cat a b")
	if string(b) != "a b a\nb\n" {
		t.Errorf("%s/%s on the server: %q, want files a and b holding their names", node.NFSExportDir, attrs["path"], b)
	}
}

// readOnGuest runs script in a pod named name on the guest node, with the guest's directory
// hostDir mounted read-only at /host, and returns what it printed once it succeeded.
func readOnGuest(ctx context.Context, t *testing.T, ns, name, hostDir, script string) []byte {
	t.Helper()
	cs := suite.Client
	dirType := corev1.HostPathDirectory
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			NodeName:                      guestNode.Name,
			Containers: []corev1.Container{{
				Name: "c", Image: cluster.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command:      []string{"sh", "-c", script},
				VolumeMounts: []corev1.VolumeMount{{Name: "host", MountPath: "/host", ReadOnly: true}},
			}},
			Volumes: []corev1.Volume{{Name: "host", VolumeSource: corev1.VolumeSource{
				HostPath: &corev1.HostPathVolumeSource{Path: hostDir, Type: &dirType}}}},
		},
	}
	if _, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := framework.WaitForPodPhase(ctx, cs, ns, name, corev1.PodSucceeded, 5*time.Minute); err != nil {
		t.Fatalf("%q in %s on the guest: %v\nevents:%s", script, hostDir, err, framework.EventsOf(ctx, cs, ns, "Pod", name))
	}
	out, err := cs.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// waitServiceAccount waits for the namespace's default ServiceAccount: pods are refused until
// it exists.
func waitServiceAccount(ctx context.Context, t *testing.T, ns string) {
	t.Helper()
	if err := framework.Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
		_, err := suite.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, err
	}); err != nil {
		t.Fatal(err)
	}
}

func ready(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func nodeNames(nodes []corev1.Node) []string {
	var names []string
	for _, n := range nodes {
		names = append(names, n.Name)
	}
	return names
}
