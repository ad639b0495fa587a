package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/dirpv/dirpv/test/framework"
)

const leaseAcquired = "successfully acquired lease"

// acquisitions counts how often a dirpv controller logged taking the leader lease (client-go
// logs "Successfully acquired lease").
func acquisitions(p *framework.Process) int {
	b, _ := os.ReadFile(p.Log)
	return strings.Count(strings.ToLower(string(b)), leaseAcquired)
}

// startStandby starts a second controller replica, name, with the extra flags beside the
// suite's controller, which has led, and returns it with its work dir.
func startStandby(t *testing.T, name string, flags ...string) (*framework.Process, string) {
	t.Helper()
	if acquisitions(ctrlProc) == 0 {
		t.Fatalf("the suite's controller never became leader:\n%s", ctrlProc.Tail(2000))
	}
	// Later tests need the suite's controller, even if this one fails half-way.
	t.Cleanup(func() {
		if exited, _ := ctrlProc.Exited(); exited {
			ctrlProc.Restart()
		}
	})
	workDir := filepath.Join(t.TempDir(), "controller")
	standby, err := suite.StartDirpv(context.Background(), name, "controller", append([]string{
		"--v=2", "--operation-timeout=10s", "--work-dir", workDir,
		"--leader-election=true", "--leader-election-namespace=kube-system",
		// client-go waits 1 to 2.2 retry periods between attempts to acquire: 1 s keeps a
		// handover well inside the few seconds TestControllerRolloutHandsOverAtOnce allows.
		"--leader-election-retry-period=1s"}, flags...)...)
	must(t, err)
	t.Cleanup(func() { standby.Stop(10 * time.Second) })
	return standby, workDir
}

// handBack makes the suite's controller the leader again before later tests: it starts it
// again, stops the standby and waits until the suite's controller has taken the lease. The
// standby, stopped cleanly, must exit 0 and leave no mount behind.
func handBack(t *testing.T, standby *framework.Process, standbyWorkDir string) {
	t.Helper()
	before := acquisitions(ctrlProc)
	must(t, ctrlProc.Restart())
	if !standby.Stop(20 * time.Second) {
		t.Error("the standby did not stop on SIGTERM")
	} else if _, err := standby.Exited(); err != nil {
		t.Errorf("the standby, stopped with SIGTERM, exited with %v, want status 0", err)
	}
	if m, _ := framework.MountsUnder(standbyWorkDir); len(m) != 0 {
		t.Errorf("the stopped controller left mounts behind: %v", m)
		framework.DetachMountsUnder(standbyWorkDir)
	}
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		return acquisitions(ctrlProc) > before, fmt.Errorf("suite controller has not retaken the lease")
	})
	must(t, err)
}

// Two controller replicas elect a leader, as the Deployment's two replicas do. The leader is
// SIGKILLed while 50 NFS claims are being provisioned, mid-way (some Bound, not all, and three
// held claims with a directory on the server but no PV): the standby takes over, the held
// claims' retried Provision adopts the directories the leader made, and every claim binds with
// exactly one PV and one directory on the server.
func TestControllerLeaderKilledMidway(t *testing.T) {
	ctx := context.Background()
	standby, workDir := startStandby(t, "controller-standby")
	leader := ctrlProc

	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, []string{"actimeo=2"}, nil)
	const n = 50
	held := []string{"c-00", "c-01", "c-02"}
	lift := blockPVsOf(t, ns, held)
	for i := 0; i < n; i++ {
		suite.CreateClaim(t, ns, fmt.Sprintf("c-%02d", i), class.Name, framework.AccessModes(v1.ReadWriteMany))
	}
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		bound, _, err := framework.BoundClaims(ctx, suite.Client, ns)
		if err != nil {
			return false, err
		}
		made := dirsOf(ns, held, claimsOnServer(t, suite.NFS, ns))
		return bound >= 5 && len(made) == len(held), fmt.Errorf("%d claims Bound, held claims' directories %v", bound, made)
	})
	must(t, err, leader)
	leader.Kill()
	snap, err := framework.TakeKillSnapshot(ctx, suite.Client, ns, suite.NFS.ExportDir, func(name string) bool {
		return strings.HasPrefix(name, ns+"-")
	})
	must(t, err)
	t.Logf("killed with %d of %d claims Bound, %d directories, %d PVs", snap.Bound, n, len(snap.Dirs), len(snap.PVPaths))
	if snap.Total != n || snap.Bound == 0 || snap.Bound >= n {
		t.Fatalf("the kill was not mid-way: %d of %d claims Bound at the kill (%d claims), want some but not all", snap.Bound, n, snap.Total)
	}
	if got := dirsOf(ns, held, snap.Names()); len(got) != len(held) {
		t.Fatalf("directories of the held claims at the kill: %v, want one each of %v", got, held)
	}
	lift()
	err = framework.Poll(ctx, timeout, func(context.Context) (bool, error) {
		return acquisitions(standby) > 0, fmt.Errorf("the standby has not taken the lease")
	})
	must(t, err, standby)

	err = framework.WaitForClaimsBound(ctx, suite.Client, ns, n, 3*time.Minute)
	must(t, err, standby)
	problems, err := framework.CheckOnePVPerClaim(ctx, suite.Client, ns, claimsOnServer(t, suite.NFS, ns))
	must(t, err)
	// Each held claim is bound to the very directory its killed attempt made.
	adoption, err := snap.CheckAdopted(ctx, suite.Client, ns, held)
	must(t, err)
	for _, p := range append(problems, adoption...) {
		t.Error(p)
	}

	handBack(t, standby, workDir)
}

// A rollout: the leader gets SIGTERM while claims keep coming. It drains, releases its NFS
// mounts and then the lease, and exits 0; the standby takes over within a few seconds, well
// below the 15 s lease duration a standby otherwise waits out; every claim binds.
// rolloutRuns counts runs of TestControllerRolloutHandsOverAtOnce in this process.
var rolloutRuns int

func TestControllerRolloutHandsOverAtOnce(t *testing.T) {
	ctx := context.Background()
	standby, standbyWorkDir := startStandby(t, "controller-standby")
	leader := ctrlProc
	leaderWorkDir := flagOf(t, leader, "--work-dir")

	// Mounts left by a controller that an earlier test SIGKILLed are not this leader's.
	leftOver, err := framework.MountsUnder(leaderWorkDir)
	must(t, err)
	ns := suite.NewNamespace(t)
	// Mount options of their own make a mount of their own, so the mount checked below is
	// this test's even when an earlier run (-count) left its export mounted.
	rolloutRuns++
	class := nfsClass(t, suite.NFS, []string{"actimeo=3", fmt.Sprintf("acregmax=%d", 60+rolloutRuns)}, nil)
	// A bound claim first, so that the leader holds an NFS mount to release.
	suite.CreateClaim(t, ns, "before", class.Name, framework.AccessModes(v1.ReadWriteMany))
	waitBound(t, ns, "before")
	if m, _ := framework.MountsUnder(leaderWorkDir); len(m) <= len(leftOver) {
		t.Fatalf("the leader holds no new NFS mount under %s after provisioning: %v", leaderWorkDir, m)
	}

	before := acquisitions(standby)
	sent := time.Now()
	leader.Terminate()
	const during = 10
	for i := 0; i < during; i++ {
		suite.CreateClaim(t, ns, fmt.Sprintf("during-%02d", i), class.Name, framework.AccessModes(v1.ReadWriteMany))
	}
	err = framework.Poll(ctx, timeout, func(context.Context) (bool, error) {
		return acquisitions(standby) > before, fmt.Errorf("the standby has not taken the lease")
	})
	handover := time.Since(sent)
	must(t, err, standby, leader)
	t.Logf("rollout handover: the standby held the lease %s after the leader got SIGTERM (lease duration 15s)", handover.Round(time.Millisecond))
	if handover > 5*time.Second {
		t.Errorf("handover took %s; a leader that releases its lease on shutdown hands over in a few seconds", handover)
	}

	err = framework.Poll(ctx, 30*time.Second, func(context.Context) (bool, error) {
		exited, _ := leader.Exited()
		return exited, fmt.Errorf("the old leader is still running")
	})
	must(t, err)
	if _, err := leader.Exited(); err != nil {
		t.Errorf("the leader, stopped with SIGTERM, exited with %v, want status 0\n%s", err, leader.Tail(3000))
	}
	after, err := framework.MountsUnder(leaderWorkDir)
	must(t, err)
	if left := slices.DeleteFunc(after, func(m string) bool { return slices.Contains(leftOver, m) }); len(left) != 0 {
		t.Errorf("the stopped leader left NFS mounts behind: %v", left)
	}
	must(t, framework.WaitForClaimsBound(ctx, suite.Client, ns, during+1, 2*time.Minute), standby)
	// The new leader's own metrics show the work it took over.
	metrics, err := framework.Scrape(ctx, standby)
	must(t, err)
	if n := metrics[`dirpv_provision_duration_seconds_count{backend="nfs",result="success"}`]; n < 1 || n > during {
		t.Errorf("new leader counts %v successful NFS provisions, want 1 to %d", n, during)
	}
	if n := metrics["dirpv_nfs_exports_mounted"]; n != 1 {
		t.Errorf("new leader reports %v mounted exports, want 1", n)
	}
	handBack(t, standby, standbyWorkDir)
}

// A leader whose API calls are throttled keeps its lease: a controller with a small client
// budget (--kube-api-qps=2, as a cluster short of API capacity would set it) provisions 40
// NFS claims at once, its 16 workers queued on that budget for many times its renew deadline
// (3 s here), and stays the leader until every claim is Bound, without exiting or losing
// the lease.
func TestThrottledLeaderKeepsItsLease(t *testing.T) {
	ctx := context.Background()
	// The suite's controller hands the lease over at once on SIGTERM.
	if !ctrlProc.Stop(30 * time.Second) {
		t.Fatalf("the suite's controller did not stop on SIGTERM:\n%s", ctrlProc.Tail(2000))
	}
	throttled, workDir := startStandby(t, "controller-throttled", "--kube-api-qps=2", "--kube-api-burst=2",
		"--leader-election-lease-duration=5s", "--leader-election-renew-deadline=3s")
	err := framework.Poll(ctx, timeout, func(context.Context) (bool, error) {
		return acquisitions(throttled) > 0, fmt.Errorf("the throttled controller has not taken the lease")
	})
	must(t, err, throttled)

	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, nil, nil)
	const n = 40
	for i := range n {
		suite.CreateClaim(t, ns, fmt.Sprintf("c-%02d", i), class.Name, framework.AccessModes(v1.ReadWriteMany))
	}
	err = framework.Poll(ctx, 4*time.Minute, func(ctx context.Context) (bool, error) {
		// An exit ends the wait: no claim binds after it.
		if exited, _ := throttled.Exited(); exited {
			return true, nil
		}
		bound, _, err := framework.BoundClaims(ctx, suite.Client, ns)
		return bound == n, fmt.Errorf("%d of %d claims Bound (err %v)", bound, n, err)
	})
	if exited, exitErr := throttled.Exited(); exited {
		t.Fatalf("the throttled controller exited (%v) while provisioning:\n%s", exitErr, throttled.Tail(4000))
	}
	if err != nil {
		t.Fatalf("%v\n--- throttled controller's log tail:\n%s", err, throttled.Tail(4000))
	}
	// The log is appended across runs of this test (go test -count): only this process's
	// lines, which klog marks with its PID, count.
	pid := fmt.Sprintf(" %d ", throttled.Pid())
	for _, line := range strings.Split(throttled.Tail(1<<30), "\n") {
		if l := strings.ToLower(line); strings.Contains(l, pid) && (strings.Contains(l, "failed to renew lease") || strings.Contains(l, "stopped leading")) {
			t.Errorf("the throttled controller stopped leading while it provisioned: %s\n%s", line, throttled.Tail(4000))
			break
		}
	}
	handBack(t, throttled, workDir)
}
