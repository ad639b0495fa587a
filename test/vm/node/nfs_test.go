package node_test

import (
	"context"
	"fmt"
	"maps"
	"path"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/node"
)

// podTimeout bounds one pod's start or end on the guest node: seconds when it is well, a
// minute or two on a busy host under emulation.
const podTimeout = 3 * time.Minute

// TestNFSv3NolockReadOnlyOnGuestNode: a class with mountOptions nfsvers=3,nolock serves a
// claim from the export by its path (NFSv3 has no pseudo root): the controller's mount and
// each pod's mount are made by the image's mount.nfs, and each pod's mount is an nfs mount of
// server:share/<volume dir> with vers=3 and nolock. A pod that mounts the claim readOnly
// reads what the other pod wrote and gets EROFS when it writes.
func TestNFSv3NolockReadOnlyOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cs := suite.Client
	ns := newNamespace(ctx, t)
	share, options := node.NFSExportDir, []string{"nfsvers=3", "nolock"}
	class := suite.CreateClass(t, "nfs-v3-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": share},
		framework.Immediate, framework.MountOptions(options...))
	suite.CreateClaim(t, ns, "v3", class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	start := time.Now()
	pv, err := framework.WaitForBoundPV(ctx, cs, ns, "v3", podTimeout)
	if err != nil {
		t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "v3"))
	}
	t.Logf("NFSv3 claim bound in %s", time.Since(start).Round(time.Millisecond))
	source := node.NFSAddr + ":" + path.Join(share, pv.Spec.CSI.VolumeAttributes["path"])
	pods := []struct {
		name, script string
		readOnly     bool
	}{
		{"rw", "echo from-rw > /data/f && cat /data/f && grep ' /data ' /proc/self/mounts", false},
		// The writer's file first (bounded), so the read-only pod shows it reads the volume.
		{"ro", `i=0; while [ ! -e /data/f ]; do i=$((i+1)); [ $i -le 600 ] || { echo "no file f"; exit 3; }; sleep 0.5; done
cat /data/f
if echo x > /data/g; then echo "write succeeded"; exit 4; fi
grep ' /data ' /proc/self/mounts`, true},
	}
	for _, p := range pods {
		createPods(ctx, t, suite.BusyboxPod(ns, p.name, "v3", p.script, p.readOnly))
	}
	for _, p := range pods {
		log := podOutput(ctx, t, ns, p.name, podTimeout)
		t.Logf("pod %s (readOnly %t) Succeeded %s after the claim bound; log:\n%s", p.name, p.readOnly, time.Since(start).Round(time.Millisecond), log)
		lines := strings.Split(strings.TrimSpace(log), "\n")
		if p.readOnly {
			// busybox sh: "sh: can't create /data/g: Read-only file system"
			if len(lines) != 3 || lines[0] != "from-rw" || !strings.Contains(lines[1], "Read-only file system") {
				t.Errorf("pod %s log %q: want the writer's file, then EROFS on its own write", p.name, log)
				continue
			}
		} else if len(lines) != 2 || lines[0] != "from-rw" {
			t.Errorf("pod %s log %q: want its file, then its mount", p.name, log)
			continue
		}
		m := strings.Fields(lines[len(lines)-1])
		if len(m) < 4 || m[0] != source || m[1] != "/data" || m[2] != "nfs" {
			t.Errorf("pod %s mount %q, want %s on /data of type nfs", p.name, lines[len(lines)-1], source)
			continue
		}
		opts := strings.Split(m[3], ",")
		want := []string{"vers=3", "nolock", "rw"}
		if p.readOnly {
			want[2] = "ro"
		}
		for _, w := range want {
			if !slices.Contains(opts, w) {
				t.Errorf("pod %s mount options %s: no %s (class mountOptions %v, readOnly %t)", p.name, m[3], w, options, p.readOnly)
			}
		}
	}
}

// TestNFSReclaimOnGuestNode: claims of three NFS classes that differ only in onDelete are
// provisioned through one mount of the export in dirpv controller's container, with the
// classes' mountOptions (nfsvers=4.1, which no other test's class asks for: the kernel's
// default is 4.2); they are used by a pod and deleted with it; on the server's exported
// directory the delete class's volume is gone, the retain class's is there with the pod's
// file, and the archive class's is renamed archived-<dir>-<time> with the pod's file.
func TestNFSReclaimOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cs := suite.Client
	ns := newNamespace(ctx, t)
	policies := []string{"delete", "retain", "archive"}
	for _, p := range policies {
		class := suite.CreateClass(t, "nfs-"+p+"-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": "/", "onDelete": p},
			framework.Immediate, framework.MountOptions("nfsvers=4.1"))
		suite.CreateClaim(t, ns, p, class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	}
	pvs := map[string]*corev1.PersistentVolume{}
	for _, p := range policies {
		pv, err := framework.WaitForBoundPV(ctx, cs, ns, p, podTimeout)
		if err != nil {
			t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", p))
		}
		pvs[p] = pv
	}
	// Within --idle-unmount (5m) of the provisioning.
	var v41 []string
	for _, m := range guestMountsOf(ctx, t, controllerProc, node.NFSAddr+":/") {
		if f := strings.Fields(m); len(f) > 3 && slices.Contains(strings.Split(f[3], ","), "vers=4.1") {
			v41 = append(v41, m)
		}
	}
	if len(v41) != 1 {
		t.Errorf("dirpv controller's mounts of %s:/ with vers=4.1: %q, want one for the three classes", node.NFSAddr, v41)
	}
	t.Logf("dirpv controller's mount for the three classes: %q", v41)
	createPods(ctx, t, reclaimWriterPod(ns, "writer", policies))
	podOutput(ctx, t, ns, "writer", podTimeout)
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "writer", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForPodDeleted(ctx, cs, ns, "writer", podTimeout); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for _, p := range policies {
		if err := cs.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, p, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range policies {
		if err := framework.WaitForPVDeleted(ctx, cs, pvs[p].Name, 2*time.Minute); err != nil {
			t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, "", "PersistentVolume", pvs[p].Name))
		}
	}
	t.Logf("three claims deleted, their PVs gone in %s", time.Since(start).Round(time.Millisecond))

	checkReclaimedOnServer(ctx, t, pvs)
}

// reclaimWriterPod returns a pod that writes, into each claim named by a policy of
// checkReclaimedOnServer, a file f holding the claim's name, and ends. One pod for all
// claims: each pod costs tens of seconds under emulation.
func reclaimWriterPod(ns, name string, policies []string) *corev1.Pod {
	var script []string
	pod := suite.BusyboxPod(ns, name, "", "", false)
	pod.Spec.Containers[0].VolumeMounts, pod.Spec.Volumes = nil, nil
	for _, p := range policies {
		script = append(script, fmt.Sprintf("echo %[1]s > /%[1]s/f", p))
		pod.Spec.Containers[0].VolumeMounts = append(pod.Spec.Containers[0].VolumeMounts, corev1.VolumeMount{Name: p, MountPath: "/" + p})
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: p, VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: p}}})
	}
	pod.Spec.Containers[0].Command = []string{"sh", "-c", strings.Join(script, " && ")}
	return pod
}

// checkReclaimedOnServer checks, on the server's exported directory as its administrator sees
// it, the volumes of deleted claims by their classes' onDelete (the keys of pvs, the PVs as
// they were before the deletion; each volume holds a file f with the policy's name): delete's
// is gone, and from the trash too; retain's is there with its file; archive's is renamed
// archived-<dir>-<time> with its file.
func checkReclaimedOnServer(ctx context.Context, t *testing.T, pvs map[string]*corev1.PersistentVolume) {
	t.Helper()
	dir := func(p string) string { return pvs[p].Spec.CSI.VolumeAttributes["path"] }
	list, err := guestNode.Exec(ctx, time.Minute, "ls", "-a", node.NFSExportDir)
	if err != nil {
		t.Fatal(err)
	}
	names := strings.Fields(list)
	t.Logf("%s on the server: %v", node.NFSExportDir, names)
	if pv, ok := pvs["delete"]; ok {
		if slices.Contains(names, dir("delete")) {
			t.Errorf("onDelete delete: %s is still in %s", dir("delete"), node.NFSExportDir)
		}
		// onDelete delete moves the volume to the trash and removes it there in the background.
		trashed := path.Join(node.NFSExportDir, ".dirpv-trash", pv.Name)
		if err := framework.Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
			out, err := guestNode.Exec(ctx, time.Minute, "sh", "-c", "if [ -e "+trashed+" ]; then echo present; fi")
			return err == nil && out == "", fmt.Errorf("%s: %q, %v", trashed, out, err)
		}); err != nil {
			t.Errorf("onDelete delete: the volume's data stays on the server: %v", err)
		}
	}
	if _, ok := pvs["retain"]; ok {
		if out, err := guestNode.Exec(ctx, time.Minute, "cat", path.Join(node.NFSExportDir, dir("retain"), "f")); err != nil || out != "retain\n" {
			t.Errorf("onDelete retain: %s/f on the server: %q, %v; want what the pod wrote", dir("retain"), out, err)
		}
	}
	if _, ok := pvs["archive"]; !ok {
		return
	}
	if slices.Contains(names, dir("archive")) {
		t.Errorf("onDelete archive: %s is still in %s under its own name", dir("archive"), node.NFSExportDir)
	}
	var archived []string
	for _, n := range names {
		if strings.HasPrefix(n, "archived-"+dir("archive")+"-") {
			archived = append(archived, n)
		}
	}
	if len(archived) != 1 {
		t.Fatalf("onDelete archive: %v in %s, want one archived-%s-<time>", archived, node.NFSExportDir, dir("archive"))
	}
	if out, err := guestNode.Exec(ctx, time.Minute, "cat", path.Join(node.NFSExportDir, archived[0], "f")); err != nil || out != "archive\n" {
		t.Errorf("onDelete archive: %s/f on the server: %q, %v; want what the pod wrote", archived[0], out, err)
	}
}

// TestNFSServerOutageOnGuestNode: the NFS server stops (every nfsd thread) while a pod writes
// to its volume through a hard mount. The pod's writes block; dirpv keeps serving other
// volumes (a pod on a local claim starts meanwhile); deleting the blocked pod completes and
// leaves no mount in the guest. Once the server is back, a new pod on the same claim works,
// dirpv not restarted. Then the volume's directory is re-created on the server (restored from
// a backup, say) under a running pod: that pod's mount gets ESTALE for good, a new pod on the
// same claim meanwhile gets a mount that works, and deleting the stale pod (the user's
// recovery) leaves no mount behind.
func TestNFSServerOutageOnGuestNode(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	cs := suite.Client
	ns := newNamespace(ctx, t)
	class := suite.CreateClass(t, "nfs-hard-"+ns, map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": "/"},
		framework.Immediate, framework.MountOptions("nfsvers=4.2", "hard"))
	suite.CreateClaim(t, ns, "nfs", class.Name, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
	suite.CreateClaim(t, ns, "local", "", framework.Request("16Mi"))
	pv, err := framework.WaitForBoundPV(ctx, cs, ns, "nfs", podTimeout)
	if err != nil {
		t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "nfs"))
	}
	volDir := pv.Spec.CSI.VolumeAttributes["path"]
	source := node.NFSAddr + ":/" + volDir
	dirpvBefore := dirpvPods(ctx, t)

	// A pod that writes a file every half second and says so.
	createPod(ctx, t, ns, "holder", "nfs", `echo before > /data/before
i=0; while :; do i=$((i+1)); echo $i > /data/tick; echo "wrote $i"; sleep 0.5; done`)
	waitForLog(ctx, t, ns, "holder", "wrote 2", podTimeout)
	if err := guestNode.StopNFS(ctx); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	t.Cleanup(func() { _ = guestNode.StartNFS(context.Background()) }) // for a test that fails before the restart
	atStop := lastWrite(podLog(ctx, ns, "holder"))

	// dirpv serves the local claim meanwhile: that pod's start is also how long the NFS pod's
	// writes are watched.
	createPod(ctx, t, ns, "local", "local", "echo local > /data/f && cat /data/f")
	if log := podOutput(ctx, t, ns, "local", podTimeout); log != "local\n" {
		t.Errorf("pod on the local claim: log %q", log)
	}
	t.Logf("pod on a local claim Succeeded %s after the NFS server stopped", time.Since(stopped).Round(time.Millisecond))
	holder, err := cs.CoreV1().Pods(ns).Get(ctx, "holder", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// One write may have been on its way when the server stopped.
	last := lastWrite(podLog(ctx, ns, "holder"))
	t.Logf("NFS pod %s %s after the server stopped: last write %d, %d when it stopped", holder.Status.Phase, time.Since(stopped).Round(time.Second), last, atStop)
	if holder.Status.Phase != corev1.PodRunning || last > atStop+1 {
		t.Errorf("NFS pod %s after %s without a server, last write %d (%d when it stopped): want it Running with its writes blocked",
			holder.Status.Phase, time.Since(stopped).Round(time.Second), last, atStop)
	}

	deleted := time.Now()
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "holder", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForPodDeleted(ctx, cs, ns, "holder", podTimeout); err != nil {
		t.Fatalf("deleting the pod whose NFS server is gone: %v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "Pod", "holder"))
	}
	t.Logf("pod on the dead server's volume deleted in %s", time.Since(deleted).Round(time.Millisecond))
	if m := guestMountsOf(ctx, t, "self", source); len(m) > 0 {
		t.Errorf("mounts of %s left in the guest after the pod's deletion: %q", source, m)
	}

	if err := guestNode.StartNFS(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("NFS server back %s after it stopped", time.Since(stopped).Round(time.Millisecond))
	// A new pod on the same claim reads the first pod's file, writes its own, and then probes
	// the volume until that fails: the next step re-creates the directory under it.
	createPod(ctx, t, ns, "after", "nfs", `cat /data/before && echo after > /data/after && cat /data/after && echo ready
i=0; while echo $i > /data/probe; do i=$((i+1)); [ $i -le 1200 ] || exit 3; sleep 0.5; done
echo "probe failed"; sleep 3600`)
	if log := waitForLog(ctx, t, ns, "after", "ready", podTimeout); !strings.HasPrefix(log, "before\nafter\nready\n") {
		t.Errorf("new pod on the claim once the server is back: log %q, want the old pod's file and its own", log)
	}
	t.Logf("new pod works on the claim %s after the server stopped", time.Since(stopped).Round(time.Millisecond))
	if after := dirpvPods(ctx, t); !maps.Equal(dirpvBefore, after) {
		t.Errorf("dirpv's pods changed across the outage: before %v, after %v", dirpvBefore, after)
	}

	// The volume's directory re-created on the server under the running pod.
	onServer := path.Join(node.NFSExportDir, volDir)
	if out, err := guestNode.Exec(ctx, time.Minute, "sh", "-c",
		"rm -rf "+onServer+" && mkdir -m 0777 "+onServer+" && echo restored > "+onServer+"/restored"); err != nil {
		t.Fatalf("re-create %s on the server: %v: %s", onServer, err, out)
	}
	recreated := time.Now()
	log := waitForLog(ctx, t, ns, "after", "probe failed", time.Minute)
	t.Logf("the running pod's mount failed %s after its directory was re-created on the server; log:\n%s", time.Since(recreated).Round(time.Millisecond), log)
	if !strings.Contains(log, "Stale file handle") {
		t.Errorf("the running pod's write failed, but not with ESTALE: %q", log)
	}
	// dirpv never hands a new pod the stale mount: one that starts while the stale pod runs
	// gets a mount that works, showing the re-created directory.
	createPod(ctx, t, ns, "fresh", "nfs", "cat /data/restored && echo fresh > /data/fresh && cat /data/fresh")
	if log := podOutput(ctx, t, ns, "fresh", podTimeout); log != "restored\nfresh\n" {
		t.Errorf("new pod beside the stale one: log %q, want the re-created directory's file and its own", log)
	}
	// The user's recovery for the stale pod: delete it (a Deployment makes a new one, with a new mount).
	if err := cs.CoreV1().Pods(ns).Delete(ctx, "after", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := framework.WaitForPodDeleted(ctx, cs, ns, "after", podTimeout); err != nil {
		t.Fatalf("deleting the pod with the stale mount: %v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "Pod", "after"))
	}
	if err := framework.Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
		m := guestMountsOf(ctx, t, "self", source)
		return len(m) == 0, fmt.Errorf("mounts of %s left in the guest: %q", source, m)
	}); err != nil {
		t.Error(err)
	}
	if after := dirpvPods(ctx, t); !maps.Equal(dirpvBefore, after) {
		t.Errorf("dirpv's pods changed: before %v, after %v", dirpvBefore, after)
	}
}

// lastWrite is the number of the last "wrote N" line of log, 0 if none.
func lastWrite(log string) int {
	last := 0
	for _, l := range strings.Split(log, "\n") {
		if n, err := strconv.Atoi(strings.TrimPrefix(l, "wrote ")); err == nil && strings.HasPrefix(l, "wrote ") {
			last = n
		}
	}
	return last
}

// controllerProc names dirpv controller's process for guestMountsOf ([-]: not the shell that
// runs pgrep, whose command line holds the pattern).
const controllerProc = "$(pgrep -o -f '[-]-work-dir=/var/lib/dirpv-controller')"

// guestMountsOf returns the mount table lines whose source is source in the mount namespace of
// the guest's process proc: "self" for the guest's root one, where kubelet and the node plugin
// mount, or controllerProc for dirpv controller's container.
func guestMountsOf(ctx context.Context, t *testing.T, proc, source string) []string {
	t.Helper()
	out, err := guestNode.Exec(ctx, time.Minute, "sh", "-c", "cat /proc/"+proc+"/mounts")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == source {
			found = append(found, l)
		}
	}
	return found
}

// dirpvPods maps each pod of dirpv's namespace to its UID and containers' restart counts: a
// restarted dirpv shows as a change.
func dirpvPods(ctx context.Context, t *testing.T) map[string]string {
	t.Helper()
	pods, err := suite.Client.CoreV1().Pods("dirpv").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, p := range pods.Items {
		var restarts []string
		for _, c := range p.Status.ContainerStatuses {
			restarts = append(restarts, fmt.Sprintf("%s:%d", c.Name, c.RestartCount))
		}
		m[p.Name] = string(p.UID) + " restarts " + strings.Join(restarts, ",")
	}
	if len(m) == 0 {
		t.Fatal("no pods in namespace dirpv")
	}
	return m
}
