package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// binDir returns the cached Kubernetes binaries or skips: a cold build takes ~15 minutes and
// does not belong inside `go test`.
func binDir(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, err := CachedBinDir(ctx)
	if errors.Is(err, ErrNotBuilt) {
		t.Skipf("skipping: %v", err)
	}
	if err != nil {
		t.Fatalf("locate binaries: %v", err)
	}
	return dir
}

// keepLogs copies component logs next to the test output when the test failed, because Stop
// removes the work dir.
func keepLogs(t *testing.T, c *Cluster) {
	if !t.Failed() || c == nil {
		return
	}
	for _, p := range c.Procs {
		t.Logf("--- %s log tail (%s):\n%s", p.Name, p.Log, logTail(p.Log, 40))
	}
}

// TestStopLeavesNothingOfANode: Stop of a node running a pod leaves no process, shim, mount,
// bridge, cgroup or directory of it on the host, and ip_forward as it was: the tiers start
// clusters one after another on one host, and `make down` must leave it clean. That pods run
// at all, every e2e test shows.
func TestStopLeavesNothingOfANode(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: starts containerd and a kubelet on this host (~30 s); not with -short")
	}
	if os.Geteuid() != 0 {
		t.Skip("skipping: a node needs root (containerd, kubelet, mounts, cgroups)")
	}
	bin := binDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	t0 := time.Now()
	c, err := Start(ctx, Options{BinDir: bin, WithNode: true, Logf: t.Logf})
	if err != nil {
		t.Fatalf("Start with node: %v", err)
	}
	t.Logf("control plane + node started in %s", time.Since(t0).Round(time.Millisecond))
	// What Stop must clean up, captured before it clears the cluster's records.
	procs := append([]*Proc(nil), c.Procs...)
	host := *c.Host
	workDir, socket := c.WorkDir, c.ContainerdSocket
	stopped := false
	defer func() {
		if !stopped {
			keepLogs(t, c)
			_ = c.Stop()
		}
	}()

	cs, err := c.Client()
	if err != nil {
		t.Fatal(err)
	}

	// A long-running pod, left running so that Stop has to tear a live pod down.
	sleeper := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "sleeper", Namespace: "default"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{
			Name: "c", Image: c.BusyboxImage, ImagePullPolicy: corev1.PullNever, Command: []string{"sleep", "3600"},
		}}},
	}
	t2 := time.Now()
	if _, err := cs.CoreV1().Pods("default").Create(ctx, sleeper, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod: %v", err)
	}
	err = poll(ctx, 2*time.Minute, 100*time.Millisecond, "pod sleeper Running", nil, func(ctx context.Context) (bool, error) {
		p, err := cs.CoreV1().Pods("default").Get(ctx, "sleeper", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return p.Status.Phase == corev1.PodRunning, fmt.Errorf("phase %s: %+v", p.Status.Phase, p.Status.ContainerStatuses)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("pod create -> Running in %s", time.Since(t2).Round(time.Millisecond))

	keepLogs(t, c)
	t3 := time.Now()
	stopped = true
	if err := c.Stop(); err != nil {
		t.Errorf("Stop: %v", err)
	}
	t.Logf("Stop took %s", time.Since(t3).Round(time.Millisecond))

	for _, p := range procs {
		if p.alive() {
			t.Errorf("%s (pid %d) still running after Stop", p.Name, p.PID)
		}
	}
	if pids := shimPIDs(socket); len(pids) > 0 {
		t.Errorf("containerd shims left: %v", pids)
	}
	for _, d := range []string{KubeletRootDir, workDir, "/run/containerd"} {
		if m := mountsUnder(d); len(m) > 0 {
			t.Errorf("mounts left under %s: %v", d, m)
		}
	}
	if host.Bridge != "" {
		if _, err := os.Stat("/sys/class/net/" + host.Bridge); err == nil {
			t.Errorf("CNI bridge %s left", host.Bridge)
		}
	}
	if b, _ := os.ReadFile("/proc/sys/net/ipv4/ip_forward"); strings.TrimSpace(string(b)) != host.IPForward {
		t.Errorf("ip_forward = %q, was %q before Start", strings.TrimSpace(string(b)), host.IPForward)
	}
	for _, d := range append(append([]string{}, host.CgroupDirs...), host.CreatedDirs...) {
		if _, err := os.Stat(d); err == nil {
			t.Errorf("%s left behind", d)
		}
	}
	if _, err := os.Stat(workDir); !os.IsNotExist(err) {
		t.Errorf("temporary work dir %s left behind", workDir)
	}
}
