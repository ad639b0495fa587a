package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
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

// Two controller replicas elect a leader, as the Deployment's two replicas do. The leader is
// SIGKILLed while 50 NFS claims are being provisioned, mid-way (some Bound, not all, and three
// held claims with a directory on the server but no PV): the standby takes over, the held
// claims' retried Provision adopts the directories the leader made, and every claim binds with
// exactly one PV and one directory on the server.
func TestControllerLeaderKilledMidway(t *testing.T) {
	ctx := context.Background()
	workDir := filepath.Join(t.TempDir(), "controller")
	standby, err := framework.StartDirpv(ctx, dirpvBin, "controller-standby", logDir, "controller",
		"--kubeconfig", testCluster.Kubeconfig, "--v=2", "--operation-timeout=10s",
		"--work-dir", workDir, "--nfs-mount-helper", mountHelper,
		"--leader-election=true", "--leader-election-namespace=kube-system")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Stop(10 * time.Second) })
	leader := ctrlProc
	if acquisitions(ctrlProc) == 0 {
		t.Fatalf("the suite's controller never became leader:\n%s", ctrlProc.Tail(2000))
	}

	ns := newNamespace(t)
	class := nfsClass(t, nfsServer, []string{"actimeo=2"}, nil)
	const n = 50
	held := []string{"c-00", "c-01", "c-02"}
	lift := blockPVsOf(t, ns, held)
	for i := 0; i < n; i++ {
		createClaim(t, ns, fmt.Sprintf("c-%02d", i), class.Name, accessModes(v1.ReadWriteMany))
	}
	err = framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		bound, _, err := framework.BoundClaims(ctx, client, ns)
		if err != nil {
			return false, err
		}
		made := dirsOf(ns, held, claimsOnServer(t, nfsServer, ns))
		return bound >= 5 && len(made) == len(held), fmt.Errorf("%d claims Bound, held claims' directories %v", bound, made)
	})
	if err != nil {
		t.Fatalf("%v\n--- leader log tail:\n%s", err, leader.Tail(3000))
	}
	// Later tests need the suite's controller, even if this one fails half-way.
	t.Cleanup(func() {
		if exited, _ := leader.Exited(); exited {
			leader.Restart()
		}
	})
	leader.Kill()
	snap, err := framework.TakeKillSnapshot(ctx, client, ns, nfsServer.ExportDir, func(name string) bool {
		return strings.HasPrefix(name, ns+"-")
	})
	if err != nil {
		t.Fatal(err)
	}
	checkKilledMidway(t, ns, snap, n, held)
	lift()
	err = framework.Poll(ctx, timeout, func(context.Context) (bool, error) {
		return acquisitions(standby) > 0, fmt.Errorf("the standby has not taken the lease")
	})
	if err != nil {
		t.Fatalf("%v\n--- standby log tail:\n%s", err, standby.Tail(3000))
	}

	err = framework.WaitForClaimsBound(ctx, client, ns, n, 3*time.Minute)
	if err != nil {
		t.Fatalf("%v\n--- standby log tail:\n%s", err, standby.Tail(3000))
	}
	problems, err := framework.CheckOnePVPerClaim(ctx, client, ns, claimsOnServer(t, nfsServer, ns))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
	checkAdopted(t, ns, snap, held)

	// Hand leadership back to the suite's controller before later tests: start it again, stop
	// the standby and wait until the suite's controller has taken the lease. A controller that
	// stops releases its NFS mounts.
	before := acquisitions(leader)
	if err := leader.Restart(); err != nil {
		t.Fatal(err)
	}
	if !standby.Stop(20 * time.Second) {
		t.Error("the standby did not stop on SIGTERM")
	}
	if m, _ := framework.MountsUnder(workDir); len(m) != 0 {
		t.Errorf("the stopped controller left mounts behind: %v", m)
		framework.DetachMountsUnder(workDir)
	}
	err = framework.Poll(ctx, timeout, func(context.Context) (bool, error) {
		return acquisitions(leader) > before, fmt.Errorf("suite controller has not retaken the lease")
	})
	if err != nil {
		t.Fatal(err)
	}
}
