package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm"
	"github.com/dirpv/dirpv/test/vm/node"
	"github.com/dirpv/dirpv/volume/quota"
)

// quotaWait bounds each wait of the quota tests: a pod's start, a write, kubelet's next stats
// (volumeStatsAggPeriod 10s), a resize, under the VM's emulation.
const quotaWait = 4 * time.Minute

// quotaCheckPeriod is the node plugin's --quota-check-period here: short, so that
// TestQuotaEscapesOnGuestDisk sees checks, long enough that a pod that has just seen one
// usually makes its moves and writes before the next (it tries again if not).
const quotaCheckPeriod = 10 * time.Second

// tenantUID is the pods' user: an ordinary, unprivileged container (no capabilities, no
// privilege escalation), which owns the files it writes.
const tenantUID = 1000

// quotaClass creates a local class on the guest disk's base whose sizes must be enforced (a
// claim that got no limit fails to provision rather than pass unnoticed) and that can grow.
func quotaClass(t *testing.T, ns string, d node.Disk) string {
	t.Helper()
	name := "quota-" + d.FSType + "-" + ns
	suite.CreateClass(t, name, map[string]string{"backend": "local", "basePath": d.Base, "capacityEnforcement": "required"},
		framework.AllowVolumeExpansion)
	return name
}

// tenantPod is a busybox pod running script as tenantUID with no capabilities, the claim at
// /data (none: no volume).
func tenantPod(ns, name, claim, script string) *corev1.Pod {
	pod := suite.BusyboxPod(ns, name, claim, script, false)
	if claim == "" {
		pod.Spec.Volumes, pod.Spec.Containers[0].VolumeMounts = nil, nil
	}
	pod.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{
		RunAsUser: ptr.To[int64](tenantUID), RunAsGroup: ptr.To[int64](tenantUID), RunAsNonRoot: ptr.To(true),
		AllowPrivilegeEscalation: ptr.To(false),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
	return pod
}

// logValue is the rest of the last log line that starts with key and a space ("size 123").
func logValue(log, key string) string {
	m := regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(key)+` (.*)$`).FindAllStringSubmatch(log, -1)
	if m == nil {
		return ""
	}
	return m[len(m)-1][1]
}

// dfSizeKiB is the size column of the last `df -Pk /data` line in the log: 1024-byte blocks.
func dfSizeKiB(t *testing.T, log string) (size, used uint64) {
	t.Helper()
	m := regexp.MustCompile(`(?m)^\S+\s+(\d+)\s+(\d+)\s+\d+\s+\d+%\s+/data$`).FindAllStringSubmatch(log, -1)
	if m == nil {
		t.Fatalf("no df line for /data in the log:\n%s", log)
	}
	last := m[len(m)-1]
	size, _ = strconv.ParseUint(last[1], 10, 64)
	used, _ = strconv.ParseUint(last[2], 10, 64)
	return size, used
}

// writeFailed reports whether the log shows dd stopped by the limit: EDQUOT (ext4) or ENOSPC
// (XFS's answer for a project over its hard limit).
func writeFailed(log string) bool {
	return strings.Contains(log, "Disk quota exceeded") || strings.Contains(log, "No space left on device")
}

// TestQuotaClaimOnGuestDisk: on the guest's XFS (prjquota) and ext4 (quota,project) disks, a
// class with `capacityEnforcement: required` gives an ordinary pod (UID 1000, no
// capabilities) a 16Mi claim whose write of 24 MiB stops with EDQUOT/ENOSPC within a few MiB of
// 16 MiB, whose `df` shows 16384 KiB, and whose size and usage kubelet reports (its stats
// summary, the figures of kubelet_volume_stats_*). A neighbour claim on the same disk still
// takes 8 MiB meanwhile. The claim grown to 32Mi online, the same container (same UID, never
// restarted) sees 32768 KiB in df and writes 8 MiB more.
func TestQuotaClaimOnGuestDisk(t *testing.T) {
	for _, d := range node.Disks {
		t.Run(d.FSType, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
			defer cancel()
			cs := suite.Client
			ns := newNamespace(ctx, t)
			class := quotaClass(t, ns, d)
			suite.CreateClaim(t, ns, "small", class, framework.Request("16Mi"))
			suite.CreateClaim(t, ns, "neighbour", class, framework.Request("16Mi"))
			// The pod fills its claim, then waits (bounded, its own loop) until its df shows
			// the grown size, and writes again; it stays up so kubelet keeps reporting it.
			createPods(ctx, t, tenantPod(ns, "filler", "small", `echo "uid $(id -u)"
dd if=/dev/zero of=/data/big bs=1M count=24 conv=fsync 2>&1; echo "dd exit $?"
echo "size $(stat -c %s /data/big)"
df -Pk /data
echo full
i=0; while [ "$(df -Pk /data | awk 'NR==2 {print $2}')" -lt 32768 ]; do i=$((i+1)); [ $i -le 900 ] || { echo "no resize seen"; exit 3; }; sleep 0.2; done
echo "uid $(id -u)"
dd if=/dev/zero of=/data/more bs=1M count=8 conv=fsync 2>&1; echo "second dd exit $?"
df -Pk /data
echo done
sleep 600`))
			log := waitForLog(ctx, t, ns, "filler", "full", quotaWait)
			t.Logf("%s: filler full after %s", d.FSType, time.Since(start).Round(time.Second))
			const size = 16 << 20
			got, _ := strconv.ParseUint(logValue(log, "size"), 10, 64)
			if !writeFailed(log) || logValue(log, "dd exit") == "0" || got > size || got < size-3<<20 {
				t.Errorf("24 MiB into a 16Mi claim on %s: the file holds %d bytes; want dd stopped by Disk quota exceeded or No space left on device within 3 MiB below %d; log:\n%s", d.FSType, got, size, log)
			}
			if dfSize, _ := dfSizeKiB(t, log); dfSize != 16384 {
				t.Errorf("df in the pod shows %d KiB, want the claim's 16384; log:\n%s", dfSize, log)
			}
			if uid := logValue(log, "uid"); uid != strconv.Itoa(tenantUID) {
				t.Errorf("the pod ran as UID %q, want %d", uid, tenantUID)
			}
			pod, err := cs.CoreV1().Pods(ns).Get(ctx, "filler", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			containerID := pod.Status.ContainerStatuses[0].ContainerID

			// The neighbour on the same disk is not touched by the full claim.
			createPods(ctx, t, tenantPod(ns, "next-door", "neighbour",
				`dd if=/dev/zero of=/data/f bs=1M count=8 conv=fsync 2>&1; echo "dd exit $?"; df -Pk /data`))
			if nlog := podOutput(ctx, t, ns, "next-door", quotaWait); logValue(nlog, "dd exit") != "0" {
				t.Errorf("neighbour claim's pod could not write 8 MiB next to a full claim: %s", nlog)
			} else if dfSize, used := dfSizeKiB(t, nlog); dfSize != 16384 || used < 8192 || used > 8192+1024 {
				t.Errorf("neighbour's df: size %d KiB, used %d KiB; want 16384 and its own 8 MiB", dfSize, used)
			}

			checkKubeletStats(ctx, t, ns, "small", size, got)

			// Online expansion: the same container, never restarted, writes past the old size.
			if err := framework.SetClaimSize(ctx, cs, ns, "small", "32Mi"); err != nil {
				t.Fatal(err)
			}
			if _, err := framework.WaitForClaimResized(ctx, cs, ns, "small", "32Mi", quotaWait); err != nil {
				t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "small"))
			}
			log = waitForLog(ctx, t, ns, "filler", "done", quotaWait)
			if logValue(log, "second dd exit") != "0" {
				t.Errorf("after the claim grew to 32Mi the pod could not write 8 MiB more: log:\n%s", log)
			}
			if dfSize, _ := dfSizeKiB(t, log); dfSize != 32768 {
				t.Errorf("df in the pod after the resize shows %d KiB, want 32768", dfSize)
			}
			if uid := logValue(log, "uid"); uid != strconv.Itoa(tenantUID) {
				t.Errorf("after the resize the pod ran as UID %q, want %d", uid, tenantUID)
			}
			pod, err = cs.CoreV1().Pods(ns).Get(ctx, "filler", metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if st := pod.Status.ContainerStatuses[0]; st.RestartCount != 0 || st.ContainerID != containerID || st.State.Running == nil {
				t.Errorf("the pod's container after the resize: %+v; want still running as %s, never restarted", st, containerID)
			}
			checkKubeletStats(ctx, t, ns, "small", 32<<20, got+8<<20)
			t.Logf("%s: done in %s", d.FSType, time.Since(start).Round(time.Second))
		})
	}
}

// checkKubeletStats waits until kubelet's stats summary, read through the API server, reports
// the claim's capacity as size and its usage as used within 1 MiB.
func checkKubeletStats(ctx context.Context, t *testing.T, ns, claim string, size, used uint64) {
	t.Helper()
	const tolerance = 1 << 20
	var last string
	err := framework.Poll(ctx, quotaWait, func(ctx context.Context) (bool, error) {
		vs, err := framework.KubeletVolumeStats(ctx, suite.Client, guestNode.Name, ns, claim)
		if err != nil {
			return false, err
		}
		if vs == nil || vs.CapacityBytes == nil || vs.UsedBytes == nil {
			return false, fmt.Errorf("kubelet has no figures for the claim yet: %+v", vs)
		}
		c, u := *vs.CapacityBytes, *vs.UsedBytes
		last = fmt.Sprintf("capacity %d, used %d", c, u)
		return c == size && u+tolerance >= used && u <= used+tolerance, fmt.Errorf("kubelet reports %s", last)
	})
	if err != nil {
		t.Errorf("kubelet's stats of claim %s: %v; want capacity %d, used %d within %d", claim, err, size, used, tolerance)
		return
	}
	t.Logf("kubelet's stats of claim %s: %s", claim, last)
}

var (
	tenantToolOnce sync.Once
	tenantToolDir  string
	tenantToolErr  error
)

// tenantTool builds the tenant tool (framework.BuildTenantTool) into a directory the guest
// sees, and returns that directory (for framework.WithTenantTool).
func tenantTool(t *testing.T) string {
	t.Helper()
	tenantToolOnce.Do(func() {
		if tenantToolDir, tenantToolErr = vm.SharedDir("tenant-"); tenantToolErr == nil {
			tenantToolErr = framework.BuildTenantTool(context.Background(), tenantToolDir)
		}
	})
	if tenantToolErr != nil {
		t.Fatal(tenantToolErr)
	}
	return tenantToolDir
}

// projectOf is the project number of the claim's volume, from its PV's quota attribute.
func projectOf(ctx context.Context, t *testing.T, ns, claim string) uint64 {
	t.Helper()
	pv, err := framework.WaitForBoundPV(ctx, suite.Client, ns, claim, quotaWait)
	if err != nil {
		t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, suite.Client, ns, "PersistentVolumeClaim", claim))
	}
	id, err := quota.ParseID(pv.Spec.CSI.VolumeAttributes["quota"])
	if err != nil || id.Kind != quota.Project {
		t.Fatalf("PV %s of claim %s: quota attribute %q (%v), want a project", pv.Name, claim, pv.Spec.CSI.VolumeAttributes["quota"], err)
	}
	return id.Num
}

// TestQuotaEscapesOnGuestDisk measures what a pod can do to its volume's project quota on
// XFS and ext4, with real pods and the kernel's FS_IOC_FSSETXATTR (test/internal/tenant, what
// `chattr -p` does), so docs/capacity.md and SECURITY.md say what holds against whom, and what dirpv's
// periodic quota check (--quota-check-period) closes:
//   - an ordinary pod (UID 1000, no capabilities) that owns its files CAN move them out of its
//     volume's project (into project 0, then write past its claim's size) or into a
//     neighbour's project;
//   - the node's next check moves them back and tells the claim (a Warning QuotaEscape event
//     naming how many and one of them): the moved file's next write fails, the volume being
//     over its limit, and the neighbour is no longer charged;
//   - it cannot move a file it does not own (EPERM), nor any file from a user namespace of its
//     own (EINVAL: the kernel allows project changes only from the initial user namespace);
//   - root in a pod with its default capabilities (CAP_FOWNER) moves other users' files too,
//     and without CAP_FOWNER it cannot;
//   - a privileged pod writes past its claim's size on ext4 (CAP_SYS_RESOURCE) but not on XFS.
//
// The tenant first moves a canary out of the project and waits until a check has moved it
// back, so that its moves and writes start with most of a period before the next check; it
// then makes sure no check moved its files back before it was done, and otherwise starts
// again after the next check (the test does not depend on how fast the guest is).
func TestQuotaEscapesOnGuestDisk(t *testing.T) {
	tools := tenantTool(t)
	for _, d := range node.Disks {
		t.Run(d.FSType, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
			defer cancel()
			ns := newNamespace(ctx, t)
			class := quotaClass(t, ns, d)
			// Placed on the node at once (as the scheduler would): the tenant's script needs
			// the neighbour's project number before any pod uses the neighbour's claim.
			for _, c := range []string{"mine", "theirs", "priv"} {
				suite.CreateClaim(t, ns, c, class, framework.Request("16Mi"), framework.OnNode(guestNode.Name))
			}
			mine, theirs := projectOf(ctx, t, ns, "mine"), projectOf(ctx, t, ns, "theirs")

			// Root with its default capabilities makes a file of its own and one of UID 1000's,
			// and moves the latter out of the project; root without CAP_FOWNER cannot move it back.
			root := suite.BusyboxPod(ns, "root", "mine", fmt.Sprintf(`P=/tools/tenant
echo "root-without-fowner: $($P set /data/by1000 %d)"`, mine), false)
			root.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{
				Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"FOWNER"}}}
			root.Spec.InitContainers = []corev1.Container{{
				Name: "owner", Image: cluster.BusyboxImage, ImagePullPolicy: corev1.PullNever,
				Command: []string{"sh", "-c", `P=/tools/tenant
echo root > /data/byroot; echo 1000 > /data/by1000; chown 1000:1000 /data/by1000
echo "root-moves-others: $($P set /data/by1000 0)"`},
				VolumeMounts: root.Spec.Containers[0].VolumeMounts,
			}}
			createPods(ctx, t, framework.WithTenantTool(root, tools))
			// A privileged pod on a claim of its own.
			priv := suite.BusyboxPod(ns, "privileged", "priv",
				`dd if=/dev/zero of=/data/big bs=1M count=24 conv=fsync 2>&1; echo "dd exit $?"; echo "size $(stat -c %s /data/big)"`, false)
			priv.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: ptr.To(true)}
			createPods(ctx, t, priv)

			if _, err := framework.WaitForPodPhase(ctx, suite.Client, ns, "root", corev1.PodSucceeded, quotaWait); err != nil {
				t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, suite.Client, ns, "Pod", "root"))
			}
			b, err := suite.Client.CoreV1().Pods(ns).GetLogs("root", &corev1.PodLogOptions{Container: "owner"}).DoRaw(ctx)
			if err != nil {
				t.Fatal(err)
			}
			rootLog := string(b) + podLog(ctx, ns, "root")
			t.Logf("%s root pod:\n%s", d.FSType, rootLog)
			if v := logValue(rootLog, "root-moves-others:"); v != "ok" {
				t.Errorf("root with CAP_FOWNER moving UID 1000's file to project 0: %q, want ok", v)
			}
			if v := logValue(rootLog, "root-without-fowner:"); !strings.Contains(v, "operation not permitted") {
				t.Errorf("root without CAP_FOWNER moving UID 1000's file: %q, want operation not permitted", v)
			}

			tenant := framework.WithTenantTool(tenantPod(ns, "tenant", "mine", fmt.Sprintf(`P=/tools/tenant
echo "others-file: $($P set /data/byroot 0)"
dd if=/dev/zero of=/data/f bs=1M count=1 conv=fsync 2>/dev/null; echo "f-project $($P get /data/f)"
echo c > /data/canary; try=0
while :; do
  try=$((try+1)); [ $try -le 5 ] || { echo "a check ran during each of 5 tries"; exit 3; }
  $P set /data/canary 0 >/dev/null
  i=0; while [ "$($P get /data/canary)" != %[1]d ]; do i=$((i+1)); [ $i -le 600 ] || { echo "no check seen"; exit 3; }; sleep 0.2; done
  rm -f /data/f /data/g; dd if=/dev/zero of=/data/f bs=1M count=1 conv=fsync 2>/dev/null
  own=$($P set /data/f 0); [ "$own" = ok ] || break
  out=$(dd if=/dev/zero of=/data/f bs=1M count=24 seek=1 conv=fsync,notrunc 2>&1); ddexit=$?; size=$(stat -c %%s /data/f)
  dd if=/dev/zero of=/data/g bs=1M count=4 conv=fsync 2>/dev/null; nb=$($P set /data/g %[2]d)
  [ "$($P get /data/f)" = 0 ] && [ "$($P get /data/g)" = %[2]d ] && break
  echo "try $try: a check moved the files back during the escape; again right after the next check"
done
echo "own-to-0: $own"; echo "$out"; echo "dd exit $ddexit"; echo "size $size"; echo "own-to-neighbour: $nb"
echo h > /data/h; echo "userns: $($P userns set /data/h 0)"; echo "h-project $($P get /data/h)"
i=0; while [ "$($P get /data/f)" != %[1]d ] || [ "$($P get /data/g)" != %[1]d ]; do i=$((i+1)); [ $i -le 600 ] || { echo "no repair seen"; exit 3; }; sleep 0.2; done
echo repaired
dd if=/dev/zero of=/data/f bs=1M count=1 seek=25 conv=fsync,notrunc 2>/tmp/err; echo "after-repair dd exit $?"; echo "after-repair: $(head -n 1 /tmp/err)"`, mine, theirs)), tools)
			tenantLog := func() string { createPods(ctx, t, tenant); return podOutput(ctx, t, ns, "tenant", quotaWait) }()
			t.Logf("%s tenant pod:\n%s", d.FSType, tenantLog)
			if v := logValue(tenantLog, "others-file:"); !strings.Contains(v, "operation not permitted") {
				t.Errorf("UID 1000 moving root's file: %q, want operation not permitted", v)
			}
			if v := logValue(tenantLog, "f-project"); v != strconv.FormatUint(mine, 10) {
				t.Errorf("the pod's new file is in project %q, want its volume's %d", v, mine)
			}
			if v := logValue(tenantLog, "own-to-0:"); v != "ok" {
				t.Errorf("UID 1000 moving its own file to project 0: %q; the kernel allowed it when this test was written", v)
			}
			// The escape: the moved file grows past the claim's size until the next check.
			if size, _ := strconv.ParseUint(logValue(tenantLog, "size"), 10, 64); logValue(tenantLog, "dd exit") != "0" || size != 25<<20 {
				t.Errorf("the file moved out of the project holds %d bytes after writing 25 MiB into a 16Mi claim (%s)", size, tenantLog)
			}
			if v := logValue(tenantLog, "own-to-neighbour:"); v != "ok" {
				t.Errorf("UID 1000 moving its own file into the neighbour's project %d: %q, want ok", theirs, v)
			}
			if v := logValue(tenantLog, "userns:"); !strings.Contains(v, "invalid argument") {
				t.Errorf("UID 1000 in a user namespace of its own moving its own file: %q, want invalid argument", v)
			}
			if v := logValue(tenantLog, "h-project"); v != strconv.FormatUint(mine, 10) {
				t.Errorf("after the refused move the file is in project %q, want %d", v, mine)
			}
			// Closed: back in the project, the file is charged to the full volume.
			if logValue(tenantLog, "after-repair dd exit") == "0" || !writeFailed(logValue(tenantLog, "after-repair:")) {
				t.Errorf("the escaped file's write after the check moved it back went in, want it stopped by the limit: %s", tenantLog)
			}
			// Earlier checks moved back the root pod's move and the canary: this one is of the
			// pass that found f and g.
			ev := waitForEscapeEvent(ctx, t, ns, "mine", func(msg string) bool {
				return strings.HasPrefix(msg, "2 ") && (strings.Contains(msg, `e.g. "f"`) || strings.Contains(msg, `e.g. "g"`))
			})
			if ev.Type != corev1.EventTypeWarning || !strings.HasPrefix(ev.Message, "2 file(s) or director(ies) of the volume had left its project quota") ||
				!strings.Contains(ev.Message, "dirpv moved them back") {
				t.Errorf("event on the claim: %s %q; want a Warning: 2 files left the project, moved back", ev.Type, ev.Message)
			}
			t.Logf("%s: event %q", d.FSType, ev.Message)

			checkHostUsersFalse(ctx, t, ns, tools)

			// The neighbour's claim, empty, is no longer charged the tenant's 4 MiB.
			createPods(ctx, t, tenantPod(ns, "neighbour", "theirs", `echo "entries $(ls -A /data | wc -l)"; df -Pk /data`))
			nlog := podOutput(ctx, t, ns, "neighbour", quotaWait)
			if _, used := dfSizeKiB(t, nlog); logValue(nlog, "entries") != "0" || used >= 4096 {
				t.Errorf("the neighbour's claim: %s; want it empty and the tenant's 4096 KiB no longer charged to it", nlog)
			}

			plog := podOutput(ctx, t, ns, "privileged", quotaWait)
			t.Logf("%s privileged pod:\n%s", d.FSType, plog)
			size, _ := strconv.ParseUint(logValue(plog, "size"), 10, 64)
			switch d.FSType {
			case "ext4": // CAP_SYS_RESOURCE passes ext4's limits.
				if logValue(plog, "dd exit") != "0" || size != 24<<20 {
					t.Errorf("a privileged pod on ext4 wrote %d bytes into a 16Mi claim, want all 24 MiB (CAP_SYS_RESOURCE): %s", size, plog)
				}
			case "xfs":
				if !writeFailed(plog) || size > 16<<20 {
					t.Errorf("a privileged pod on XFS wrote %d bytes into a 16Mi claim, want it stopped at the limit: %s", size, plog)
				}
			}
			t.Logf("%s: done in %s", d.FSType, time.Since(start).Round(time.Second))
		})
	}
}

// waitForEscapeEvent waits for a QuotaEscape event on the claim whose message is one that
// want accepts.
func waitForEscapeEvent(ctx context.Context, t *testing.T, ns, claim string, want func(string) bool) *corev1.Event {
	t.Helper()
	var found *corev1.Event
	err := framework.Poll(ctx, quotaWait, func(ctx context.Context) (bool, error) {
		evs, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=" + claim})
		if err != nil {
			return false, err
		}
		var seen []string
		for i, e := range evs.Items {
			if e.Reason == provisioner.ReasonQuotaEscape && want(e.Message) {
				found = &evs.Items[i]
				return true, nil
			}
			seen = append(seen, e.Reason+": "+e.Message)
		}
		return false, fmt.Errorf("events so far: %q", seen)
	})
	if err != nil {
		t.Fatalf("QuotaEscape event on claim %s/%s: %v", ns, claim, err)
	}
	return found
}

// checkHostUsersFalse has the tenant move its own file from a pod with `hostUsers: false` (a
// user namespace of the pod's own), which the kernel must refuse (EINVAL), where the node's
// runtime says it runs such pods. Debian's containerd 1.6 does not: kubelet then refuses the
// pod's sandbox ("runtime does not support user namespaces"), and the test logs the node's
// report instead of waiting for that.
func checkHostUsersFalse(ctx context.Context, t *testing.T, ns, tools string) {
	t.Helper()
	n, err := suite.Client.CoreV1().Nodes().Get(ctx, guestNode.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	supported := false
	for _, h := range n.Status.RuntimeHandlers {
		if h.Name == "" && h.Features != nil && h.Features.UserNamespaces != nil {
			supported = *h.Features.UserNamespaces
		}
	}
	if !supported {
		handlers, _ := json.Marshal(n.Status.RuntimeHandlers)
		t.Logf("hostUsers: false is not tested: node %s's runtime reports no user namespace support (runtime handlers %s)", n.Name, handlers)
		return
	}
	pod := framework.WithTenantTool(tenantPod(ns, "userns-pod", "mine", `P=/tools/tenant
echo u > /data/u; echo "userns-pod-own-to-0: $($P set /data/u 0)"`), tools)
	pod.Spec.HostUsers = ptr.To(false)
	createPods(ctx, t, pod)
	log := podOutput(ctx, t, ns, pod.Name, quotaWait)
	if v := logValue(log, "userns-pod-own-to-0:"); !strings.Contains(v, "invalid argument") {
		t.Errorf("a hostUsers: false pod moving its own file to project 0: %q, want invalid argument; log:\n%s", v, log)
	}
}
