package e2e

// NFS volumes in real pods: kubelet calls dirpv's node plugin, which mounts server:/share/path
// for each pod through the test-only FUSE NFS client (`dirpv node --nfs-mount-helper`), so
// every pod below has its own NFS mount of the volume, as with the kernel client.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/nfs"
)

// nfsE2EClass creates an Immediate NFS class on the suite's server. The port options point
// the mount at this server (the portmapper only knows the last one started).
func nfsE2EClass(t *testing.T, name string) []string {
	t.Helper()
	opts := append(suite.NFS.MountOptions(), "nolock", "actimeo=1")
	suite.CreateClass(t, name, map[string]string{"backend": "nfs", "server": suite.NFS.Addr, "share": suite.NFS.Share}, framework.Immediate, framework.MountOptions(opts...))
	return opts
}

// checkPodNFSMount checks that the pod's volume is an NFS mount of the volume's own directory
// on the server, with the PV's mount options, read-only or not as asked.
func checkPodNFSMount(t *testing.T, pod *v1.Pod, pvName, path string, mountOptions []string, readOnly bool) {
	t.Helper()
	target := volumeTarget(pod, pvName)
	if m := mountsUnder(t, target, "fuse.nfs"); len(m) != 1 {
		t.Fatalf("fuse.nfs mounts at pod %s's volume target %s: %v, want exactly one (all mounts there: %v)", pod.Name, target, m, mountsUnder(t, target))
	}
	rec, err := nfs.ReadMountRecord(target)
	if err != nil {
		t.Fatal(err)
	}
	if want := suite.NFS.Source(path); rec.Source != want {
		t.Errorf("pod %s mounts %s, want %s", pod.Name, rec.Source, want)
	}
	for _, o := range mountOptions {
		if !slices.Contains(rec.Options, o) {
			t.Errorf("pod %s's NFS mount options %q lack the PV's %q", pod.Name, rec.Options, o)
		}
	}
	if rec.ReadOnly != readOnly {
		t.Errorf("pod %s's NFS mount read-only = %t, want %t (options %q)", pod.Name, rec.ReadOnly, readOnly, rec.Options)
	}
}

// waitLogLine waits until the pod printed a line matching re and returns its submatches.
func waitLogLine(t *testing.T, ns, pod string, re *regexp.Regexp) []string {
	t.Helper()
	var m []string
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		logs := podLogs(t, ns, pod)
		m = re.FindStringSubmatch(logs)
		return m != nil, fmt.Errorf("pod %s logs so far: %q", pod, logs)
	})
	if err != nil {
		t.Fatalf("%v\n--- node plugin log tail:\n%s", err, nodeProc.Tail(3000))
	}
	return m
}

// mountDaemon returns the PID of the helper daemon serving the NFS mount at target, so that a
// test can check it exits after the unmount (a check that is skipped when the record is
// unreadable would pass without checking anything).
func mountDaemon(t *testing.T, target string) int {
	t.Helper()
	rec, err := nfs.ReadMountRecord(target)
	if err != nil {
		t.Fatalf("mount record of %s: %v", target, err)
	}
	return rec.PID
}

// checkNoNFSMountsLeft waits until no fuse.nfs mount is left under kubelet's root and the
// helper daemons that served the pods' mounts have exited.
func checkNoNFSMountsLeft(t *testing.T, daemons []int) {
	t.Helper()
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		if m := mountsUnder(t, suite.Cluster.KubeletRootDir, "fuse.nfs"); len(m) > 0 {
			return false, fmt.Errorf("fuse.nfs mounts left under %s: %v", suite.Cluster.KubeletRootDir, m)
		}
		for _, pid := range daemons {
			if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
				return false, fmt.Errorf("NFS mount daemon pid %d still running", pid)
			}
		}
		return true, nil
	})
	if err != nil {
		t.Fatalf("%v\n--- node plugin log tail:\n%s", err, nodeProc.Tail(3000))
	}
}

var sumLine = regexp.MustCompile(`(?m)^([0-9a-f]{64})  /data/blob$`)

// Two pods share one RWX claim, each through its own NFS mount: what one writes, the other
// reads byte for byte, and the server holds the same bytes. Once the pods are gone, so are
// their mounts.
func TestNFSTwoPodsShareOneVolume(t *testing.T) {
	ns := suite.NewNamespace(t)
	mountOptions := nfsE2EClass(t, "e2e-nfs-rwx")
	suite.CreateClaim(t, ns, "shared", "e2e-nfs-rwx", framework.AccessModes(v1.ReadWriteMany))
	pv := boundPV(t, ns, "shared")
	path := pv.Spec.CSI.VolumeAttributes["path"]

	// The writer renames into place so that the reader never sees a half-written file.
	createPod(t, suite.BusyboxPod(ns, "writer", "shared",
		`head -c 1048576 /dev/urandom > /data/.blob && mv /data/.blob /data/blob && sha256sum /data/blob && sleep 3600`, false))
	createPod(t, suite.BusyboxPod(ns, "reader", "shared",
		`until [ -f /data/blob ]; do sleep 0.2; done; sha256sum /data/blob; sleep 3600`, false))
	writer := waitPodPhase(t, ns, "writer", v1.PodRunning)
	reader := waitPodPhase(t, ns, "reader", v1.PodRunning)

	wrote := waitLogLine(t, ns, "writer", sumLine)[1]
	read := waitLogLine(t, ns, "reader", sumLine)[1]
	if read != wrote {
		t.Errorf("reader saw sha256 %s, writer wrote %s", read, wrote)
	}
	onServer, err := os.ReadFile(filepath.Join(suite.NFS.ExportDir, path, "blob"))
	if err != nil {
		t.Fatalf("the file on the NFS server: %v", err)
	}
	if sum := sha256.Sum256(onServer); hex.EncodeToString(sum[:]) != wrote || len(onServer) != 1<<20 {
		t.Errorf("server holds %d bytes with sha256 %x, writer wrote 1 MiB with %s", len(onServer), sum, wrote)
	}

	var daemons []int
	for _, pod := range []*v1.Pod{writer, reader} {
		checkPodNFSMount(t, pod, pv.Name, path, mountOptions, false)
		daemons = append(daemons, mountDaemon(t, volumeTarget(pod, pv.Name)))
	}
	if daemons[0] == daemons[1] {
		t.Errorf("both pods are served by one mount daemon (pid %d); each should have its own mount", daemons[0])
	}

	deletePod(t, ns, "writer")
	deletePod(t, ns, "reader")
	checkNoNFSMountsLeft(t, daemons)
	// The data outlives the pods.
	if b, err := os.ReadFile(filepath.Join(suite.NFS.ExportDir, path, "blob")); err != nil || len(b) != 1<<20 {
		t.Errorf("the file after the pods are gone: %d bytes, %v", len(b), err)
	}
}

// A pod that mounts its NFS claim read-only gets a read-only NFS mount and EROFS on write.
func TestNFSReadOnlyPodCannotWrite(t *testing.T) {
	ns := suite.NewNamespace(t)
	mountOptions := nfsE2EClass(t, "e2e-nfs-ro")
	suite.CreateClaim(t, ns, "data", "e2e-nfs-ro", framework.AccessModes(v1.ReadWriteMany))
	pv := boundPV(t, ns, "data")
	path := pv.Spec.CSI.VolumeAttributes["path"]

	// The pod reports what the write did, then stays up so its mount can be inspected.
	createPod(t, suite.BusyboxPod(ns, "ro", "data",
		`if out=$(touch /data/x 2>&1); then echo "write: allowed"; else echo "write: refused: $out"; fi; sleep 3600`, true))
	pod := waitPodPhase(t, ns, "ro", v1.PodRunning)
	line := waitLogLine(t, ns, "ro", regexp.MustCompile(`write: (.*)`))[1]
	if !strings.Contains(line, "Read-only file system") {
		t.Errorf("write in a read-only pod: %q, want refused with EROFS (Read-only file system)", line)
	}
	checkPodNFSMount(t, pod, pv.Name, path, mountOptions, true)
	// A missing directory would read as empty: require it to be there.
	if got, err := os.ReadDir(filepath.Join(suite.NFS.ExportDir, path)); err != nil || len(got) != 0 {
		t.Errorf("read-only pod's volume directory on the server: %v %v, want it there and empty", got, err)
	}
	daemons := []int{mountDaemon(t, volumeTarget(pod, pv.Name))}
	deletePod(t, ns, "ro")
	checkNoNFSMountsLeft(t, daemons)
}
