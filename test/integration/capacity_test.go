package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/dirpv/dirpv/internal/daemon"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// capacityNode is a fake Ready node with a dirpv node instance of its own, whose base is a
// 64 MiB tmpfs in a mount namespace of its own: two nodes' bases at the same path, as two
// machines have.
type capacityNode struct {
	name, ns      string
	wrapper, work string
	proc          *framework.Process
	owner         *v1.Pod
	// flags are given to the node's instance after the test's defaults, which they override.
	flags []string
}

// baseDir is where the node's base is, seen from the host.
func (n *capacityNode) baseDir(base string) string {
	return filepath.Join(fmt.Sprintf("/proc/%d/root", n.proc.Pid()), base)
}

const capacityLabel = "dirpv.io/capacity-test"

// startCapacityNode creates the node, the Pod that stands for its dirpv pod (bound to it; fake
// nodes run nothing) and the node instance, owned by that Pod, with fill bytes already used
// on its base and the extra flags.
func startCapacityNode(t *testing.T, ns, name, base string, fill int, flags ...string) *capacityNode {
	t.Helper()
	ctx := context.Background()
	must(t, suite.Cluster.CreateReadyNode(ctx, name, map[string]string{"kubernetes.io/hostname": "host-" + name, capacityLabel: "yes"}))
	t.Cleanup(func() { suite.Client.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{}) })
	must(t, suite.Cluster.RegisterCSIDriver(ctx, name, "dirpv.io"))
	n := &capacityNode{name: name, ns: ns, wrapper: filepath.Join(t.TempDir(), "dirpv-"+name), work: t.TempDir(), flags: flags}
	script := fmt.Sprintf("#!/bin/sh\nexec unshare --mount --propagation private -- /bin/sh -ec "+
		"'mount -t tmpfs -o size=64m tmpfs \"$0\"; head -c %d /dev/zero > \"$0/filler\"; exec %s \"$@\"' %s \"$@\"\n",
		fill, suite.Dirpv, base)
	must(t, os.WriteFile(n.wrapper, []byte(script), 0o755))
	n.start(t, base, "dirpv-node-"+name)
	return n
}

// start runs the node's instance, owned by a new Pod named pod.
func (n *capacityNode) start(t *testing.T, base, pod string) {
	t.Helper()
	ctx := context.Background()
	owner, err := suite.Client.CoreV1().Pods(n.ns).Create(ctx, &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod},
		Spec: v1.PodSpec{NodeName: n.name, Containers: []v1.Container{{Name: "dirpv", Image: "dirpv"}},
			Tolerations: []v1.Toleration{{Operator: v1.TolerationOpExists}}},
	}, metav1.CreateOptions{})
	must(t, err)
	proc, err := suite.StartDirpvBin(ctx, n.wrapper, pod, "node", append([]string{
		"--v=2", "--node-name", n.name, "--allowed-base-paths", base,
		"--csi-endpoint", "unix://" + filepath.Join(n.work, "csi.sock"), "--plugin-registration-dir", "-",
		"--capacity-poll-interval=2s", "--capacity-namespace", n.ns, "--pod-name", owner.Name, "--pod-uid", string(owner.UID)}, n.flags...)...)
	must(t, err)
	t.Cleanup(func() { proc.Stop(10 * time.Second) })
	n.proc, n.owner = proc, owner
}

// csiDriverFromDeploy creates the CSIDriver object that deploy/ installs, storageCapacity
// included, and removes it after the test (the other tests' claims do not wait for capacity).
func csiDriverFromDeploy(t *testing.T) {
	t.Helper()
	d := deployedCSIDriver(t)
	if d.Spec.StorageCapacity == nil || !*d.Spec.StorageCapacity {
		t.Fatalf("deploy/base/csidriver.yaml: storageCapacity is not true")
	}
	ctx := context.Background()
	_, err := suite.Client.StorageV1().CSIDrivers().Create(ctx, d, metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		suite.Client.StorageV1().CSIDrivers().Delete(context.Background(), d.Name, metav1.DeleteOptions{})
		framework.WaitForDeleted(context.Background(), timeout, "CSIDriver "+d.Name, func(ctx context.Context) (string, error) {
			_, err := suite.Client.StorageV1().CSIDrivers().Get(ctx, d.Name, metav1.GetOptions{})
			return "", err
		})
	})
}

// deployedCSIDriver returns the CSIDriver object deploy/ installs.
func deployedCSIDriver(t *testing.T) *storagev1.CSIDriver {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(framework.RepoRoot(), "deploy/base/csidriver.yaml"))
	must(t, err)
	d := &storagev1.CSIDriver{}
	must(t, yaml.UnmarshalStrict(data, d))
	return d
}

// capacityOf returns the CSIStorageCapacity objects in ns for class, by the node name their
// managed-by label ends in.
func capacityOf(ctx context.Context, ns, class string) (map[string]storagev1.CSIStorageCapacity, error) {
	list, err := suite.Client.StorageV1().CSIStorageCapacities(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	out := map[string]storagev1.CSIStorageCapacity{}
	for _, c := range list.Items {
		if c.StorageClassName == class {
			// A node instance's by its node, the controller's as it is.
			node := strings.TrimPrefix(c.Labels["csi.storage.k8s.io/managed-by"], "dirpv.io-node-")
			if _, dup := out[node]; dup {
				return nil, fmt.Errorf("two objects for class %s and node %s", class, node)
			}
			out[node] = c
		}
	}
	return out, nil
}

// waitCapacity polls until cond holds for the class's objects and returns them.
func waitCapacity(t *testing.T, ns, class, what string, cond func(map[string]storagev1.CSIStorageCapacity) bool) map[string]storagev1.CSIStorageCapacity {
	t.Helper()
	var got map[string]storagev1.CSIStorageCapacity
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		var err error
		got, err = capacityOf(ctx, ns, class)
		return err == nil && cond(got), err
	})
	if err != nil {
		var lines []string
		for n, c := range got {
			lines = append(lines, fmt.Sprintf("%s: %s %v owners %v", n, c.Capacity, c.NodeTopology, c.OwnerReferences))
		}
		t.Fatalf("CSIStorageCapacity of class %s: want %s: %v; have %v", class, what, err, lines)
	}
	return got
}

func bytesOf(c storagev1.CSIStorageCapacity) int64 {
	if c.Capacity == nil {
		return -1
	}
	return c.Capacity.Value()
}

// Two nodes, each with its own dirpv node instance and base, one base nearly full. Each
// instance publishes its base's free space for the WaitForFirstConsumer local class, selecting
// its node by hostname; the scheduler puts a claim's pod on the node with room and refuses to
// put it where the claim does not fit. The figures follow what is written; an object goes
// with its owner Pod, and with its class.
func TestCapacitySteersScheduling(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	csiDriverFromDeploy(t)
	base := filepath.Join(suite.Work.BaseRoot, "capacity")
	must(t, os.MkdirAll(base, 0o755))
	full := startCapacityNode(t, ns, "cap-full", base, 60<<20)
	room := startCapacityNode(t, ns, "cap-room", base, 0)
	class := suite.CreateClass(t, "capacity", map[string]string{"backend": "local", "basePath": base})

	got := waitCapacity(t, ns, class.Name, "4Mi on cap-full, 64Mi on cap-room", func(c map[string]storagev1.CSIStorageCapacity) bool {
		return bytesOf(c[full.name]) == 4<<20 && bytesOf(c[room.name]) == 64<<20
	})
	for _, n := range []*capacityNode{full, room} {
		c := got[n.name]
		if want := map[string]string{"kubernetes.io/hostname": "host-" + n.name}; c.NodeTopology == nil ||
			len(c.NodeTopology.MatchExpressions) != 0 || fmt.Sprint(c.NodeTopology.MatchLabels) != fmt.Sprint(want) {
			t.Errorf("%s: nodeTopology %v, want matchLabels %v", n.name, c.NodeTopology, want)
		}
		if len(c.OwnerReferences) != 1 || c.OwnerReferences[0].UID != n.owner.UID {
			t.Errorf("%s: owners %v, want the Pod %s", n.name, c.OwnerReferences, n.owner.Name)
		}
	}

	pod := func(name, claim string, selector map[string]string) {
		t.Helper()
		p := &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: v1.PodSpec{NodeSelector: selector, Containers: []v1.Container{{Name: "c", Image: "busybox"}},
				Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
					PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}},
		}
		_, err := suite.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		must(t, err)
	}
	// Either node would do but for capacity.
	suite.CreateClaim(t, ns, "fits", class.Name, framework.Request("16Mi"))
	pod("app", "fits", map[string]string{capacityLabel: "yes"})
	pvc, err := framework.WaitForPVCBound(ctx, suite.Client, ns, "fits", timeout)
	must(t, err, room.proc)
	if node := pvc.Annotations["volume.kubernetes.io/selected-node"]; node != room.name {
		t.Errorf("the scheduler chose %q, want %s (cap-full has 4Mi free for a 16Mi claim)", node, room.name)
	}
	// Pinned to the full node, a claim that does not fit is never sent there.
	suite.CreateClaim(t, ns, "too-big", class.Name, framework.Request("16Mi"))
	pod("stuck", "too-big", map[string]string{"kubernetes.io/hostname": "host-" + full.name})
	waitEvent(t, ns, "Pod", "stuck", "FailedScheduling", "enough free storage")
	if node, ok := getClaim(t, ns, "too-big").Annotations["volume.kubernetes.io/selected-node"]; ok {
		t.Errorf("claim too-big was placed on %s", node)
	}

	// Data written into the volume shows in the node's figure within a poll or two.
	pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	must(t, err)
	data := filepath.Join(room.baseDir(base), pv.Spec.CSI.VolumeAttributes["path"], "data")
	must(t, os.WriteFile(data, make([]byte, 32<<20), 0o644))
	waitCapacity(t, ns, class.Name, "32Mi on cap-room after 32 MiB were written", func(c map[string]storagev1.CSIStorageCapacity) bool {
		return bytesOf(c[room.name]) == 32<<20
	})

	// The node's dirpv pod is replaced (an upgrade) while the old one still exists: the new
	// instance takes over the object, without a duplicate or a gap, and keeps it current
	// (its base is a fresh tmpfs: 64Mi again).
	adopted := waitCapacity(t, ns, class.Name, "cap-room's object", func(c map[string]storagev1.CSIStorageCapacity) bool {
		return bytesOf(c[room.name]) > 0
	})[room.name].UID
	room.proc.Stop(10 * time.Second)
	// The fresh tmpfs replaces a base that held a volume, on purpose: the admin removes the
	// base's record, else the node refuses the base as a disk that did not mount (docs/capacity.md).
	must(t, os.RemoveAll(filepath.Join(room.work, "bases")))
	room.start(t, base, "dirpv-node-"+room.name+"-2")
	got = waitCapacity(t, ns, class.Name, "cap-room's object owned by its new pod, 64Mi", func(c map[string]storagev1.CSIStorageCapacity) bool {
		o := c[room.name]
		return bytesOf(o) == 64<<20 && len(o.OwnerReferences) == 1 && o.OwnerReferences[0].UID == room.owner.UID
	})
	if got[room.name].UID != adopted {
		t.Errorf("cap-room's object was made anew (%s, was %s), not adopted", got[room.name].UID, adopted)
	}

	// The node instance and its pod go (the node is drained, or dirpv uninstalled): so does
	// the node's object, by garbage collection; the other node's stays.
	full.proc.Stop(10 * time.Second)
	must(t, suite.Client.CoreV1().Pods(ns).Delete(ctx, full.owner.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	waitCapacity(t, ns, class.Name, "no object for cap-full once its pod is gone", func(c map[string]storagev1.CSIStorageCapacity) bool {
		_, ok := c[full.name]
		return !ok && bytesOf(c[room.name]) >= 0
	})

	// Without its class, a node publishes nothing for it.
	if err := suite.Client.StorageV1().StorageClasses().Delete(ctx, class.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	waitCapacity(t, ns, class.Name, "none once the class is deleted", func(c map[string]storagev1.CSIStorageCapacity) bool {
		return len(c) == 0
	})
	// The claim's pod never ran (no kubelet): force it away, or the claim's protection waits on it.
	must(t, suite.Client.CoreV1().Pods(ns).Delete(ctx, "app", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	deleteClaim(t, ns, "fits")
	waitPVGone(t, pv.Name)
}

// An NFS class that waits for its first consumer must keep scheduling once the CSIDriver asks
// the scheduler to check capacity: the controller publishes one object for it in dirpv's
// namespace, owned by the CSIDriver, that selects every node, with the export's free space. A
// CSIDriver deleted and created again (an uninstall and reinstall, an upgrade that replaces it
// for its immutable fields) has a new UID: the object must come back under the new one, not be
// published for ever under the old one, which the garbage collector deletes as soon as it is
// made. The object goes with its class.
func TestCapacityNFSClassSchedules(t *testing.T) {
	ctx := context.Background()
	csiDriverFromDeploy(t)
	home := daemon.DefaultNamespace
	class := nfsClass(t, suite.NFS, []string{"nolock"}, nil, func(c *storagev1.StorageClass) {
		c.VolumeBindingMode = ptr.To(storagev1.VolumeBindingWaitForFirstConsumer)
	})
	ownedBy := func(uid types.UID) func(map[string]storagev1.CSIStorageCapacity) bool {
		return func(c map[string]storagev1.CSIStorageCapacity) bool {
			o, ok := c["dirpv.io-controller"]
			return len(c) == 1 && ok && bytesOf(o) > 0 && len(o.OwnerReferences) == 1 && o.OwnerReferences[0].UID == uid
		}
	}
	drivers := suite.Client.StorageV1().CSIDrivers()
	first, err := drivers.Get(ctx, "dirpv.io", metav1.GetOptions{})
	must(t, err)
	c := waitCapacity(t, home, class.Name, "one all-nodes object owned by the CSIDriver", ownedBy(first.UID))["dirpv.io-controller"]
	if c.NodeTopology == nil || len(c.NodeTopology.MatchLabels) != 0 || len(c.NodeTopology.MatchExpressions) != 0 {
		t.Errorf("nodeTopology %v, want {} (every node)", c.NodeTopology)
	}
	var st unix.Statfs_t
	must(t, unix.Statfs(suite.NFS.ExportDir, &st))
	if free := int64(st.Bavail) * st.Bsize; bytesOf(c) > free+free/16 || bytesOf(c) < free-free/16 {
		t.Errorf("capacity %s, want about the export's free space %d", c.Capacity, free)
	}

	ns := suite.NewNamespace(t)
	suite.CreateClaim(t, ns, "shared", class.Name, framework.AccessModes(v1.ReadWriteMany))
	createPod(t, ns, "app", "shared", nodeC)
	pvc, _ := waitBound(t, ns, "shared")
	if node := pvc.Annotations["volume.kubernetes.io/selected-node"]; node != nodeC {
		t.Errorf("selected node %q, want %s", node, nodeC)
	}

	must(t, drivers.Delete(ctx, first.Name, metav1.DeleteOptions{}))
	must(t, framework.WaitForDeleted(ctx, timeout, "CSIDriver "+first.Name, func(ctx context.Context) (string, error) {
		_, err := drivers.Get(ctx, first.Name, metav1.GetOptions{})
		return "", err
	}))
	second, err := drivers.Create(ctx, deployedCSIDriver(t), metav1.CreateOptions{})
	must(t, err)
	waitCapacity(t, home, class.Name, "one object owned by the new CSIDriver", ownedBy(second.UID))

	must(t, suite.Client.StorageV1().StorageClasses().Delete(ctx, class.Name, metav1.DeleteOptions{}))
	waitCapacity(t, home, class.Name, "none once the class is deleted", func(c map[string]storagev1.CSIStorageCapacity) bool {
		return len(c) == 0
	})
}

// With capacity on, no node publishes room for a local class it cannot parse, so the scheduler
// places its claims nowhere and no node instance ever sees them. The controller says why on the
// claim instead, and nothing is created.
func TestUnservableLocalClassIsReportedBeforeScheduling(t *testing.T) {
	csiDriverFromDeploy(t)
	ns := suite.NewNamespace(t)
	class, base := localClass(t, map[string]string{"bsaePath": "/tmp"})
	suite.CreateClaim(t, ns, "c", class.Name)
	createPod(t, ns, "app", "c", nodeA)
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "c", provisioner.ReasonUnservableClass, "dirpv cannot provision this claim of StorageClass")
	if !strings.Contains(ev.Message, `"bsaePath"`) || ev.Source.Component != "dirpv.io-controller" {
		t.Errorf("event from %q: %q; want the controller naming the unknown parameter", ev.Source.Component, ev.Message)
	}
	pvc := getClaim(t, ns, "c")
	if node := pvc.Annotations["volume.kubernetes.io/selected-node"]; node != "" || pvc.Spec.VolumeName != "" {
		t.Errorf("claim of an unservable class was placed on %q / bound to %q", node, pvc.Spec.VolumeName)
	}
	if got := entries(t, base); len(got) != 0 {
		t.Errorf("unservable claim left %v in the base", got)
	}
}

// A snapshot's copy takes space on its base, and deleting it gives the space back: the
// node's published free space follows at once, as it does after a Provision or a Delete, not
// at the next poll (an hour here), and dirpv_snapshot_used_bytes reports what the snapshot
// holds, under its VolumeSnapshot and content, until it is deleted. On this tmpfs base, as on
// every base (quota limits reserve nothing), the published figure is the file system's free
// space, which counts the copy's blocks.
func TestSnapshotCountsInPublishedCapacity(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	csiDriverFromDeploy(t)
	base := filepath.Join(suite.Work.BaseRoot, "capacity-snapshot")
	must(t, os.MkdirAll(base, 0o755))
	n := startCapacityNode(t, ns, "cap-snap", base, 0, "--capacity-poll-interval=1h")
	class := suite.CreateClass(t, "capacity-snapshot", map[string]string{"backend": "local", "basePath": base})
	waitCapacity(t, ns, class.Name, "64Mi on cap-snap", func(c map[string]storagev1.CSIStorageCapacity) bool {
		return bytesOf(c[n.name]) == 64<<20
	})
	suite.CreateClaim(t, ns, "src", class.Name, framework.OnNode(n.name), framework.Request("16Mi"))
	pvc, err := framework.WaitForPVCBound(ctx, suite.Client, ns, "src", timeout)
	must(t, err, n.proc)
	pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	must(t, err)
	const data = 12 << 20
	must(t, os.WriteFile(filepath.Join(n.baseDir(base), pv.Spec.CSI.VolumeAttributes["path"], "data"), make([]byte, data), 0o644))

	// 64 MiB less the data and its copy (and a few KiB of the snapshot's record, rounded
	// down to the MiB).
	vs, content := takeSnapshot(t, ns, "snap", "src", snapshotClass(t, snapshotv1.VolumeSnapshotContentDelete))
	waitCapacity(t, ns, class.Name, "at most 40Mi on cap-snap once the snapshot holds a copy of 12 MiB", func(c map[string]storagev1.CSIStorageCapacity) bool {
		b := bytesOf(c[n.name])
		return b >= 38<<20 && b <= 40<<20
	})
	series := fmt.Sprintf(`dirpv_snapshot_used_bytes{namespace=%q,volumesnapshot=%q,volumesnapshotcontent=%q}`, ns, vs.Name, content.Name)
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		m, err := framework.Scrape(ctx, n.proc)
		if err != nil {
			return false, err
		}
		v, ok := m[series]
		if !ok {
			return false, fmt.Errorf("no %s on /metrics", series)
		}
		if v < data || v > data+1<<20 {
			return false, fmt.Errorf("%s is %v, want the copy's %d bytes and at most a MiB more", series, v, data)
		}
		return true, nil
	})
	must(t, err)

	must(t, snaps.SnapshotV1().VolumeSnapshots(ns).Delete(ctx, vs.Name, metav1.DeleteOptions{}))
	waitCapacity(t, ns, class.Name, "52Mi on cap-snap once the snapshot is deleted", func(c map[string]storagev1.CSIStorageCapacity) bool {
		b := bytesOf(c[n.name])
		return b >= 51<<20 && b <= 52<<20
	})
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		m, err := framework.Scrape(ctx, n.proc)
		if _, ok := m[series]; err == nil && ok {
			return false, fmt.Errorf("%s is still on /metrics", series)
		}
		return err == nil, err
	})
	must(t, err)
}
