package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// The user's story for the default local class: a pod writes, the file is in the volume's
// directory on the node, the pod goes away without leaving a mount, and the next pod on the
// same claim sees the data.
func TestLocalVolumeKeepsDataAcrossPods(t *testing.T) {
	ns := suite.NewNamespace(t)
	base := filepath.Join(suite.Work.BaseRoot, "keeps-data")
	suite.CreateClass(t, "e2e-local", map[string]string{"backend": "local", "basePath": base})
	suite.CreateClaim(t, ns, "data", "e2e-local")

	suite.CreatePod(t, suite.BusyboxPod(ns, "writer", "data", "echo hello-dirpv > /data/greeting && sync && sleep 3600", false))
	writer := waitPodPhase(t, ns, "writer", v1.PodRunning)
	pv := boundPV(t, ns, "data")
	onDisk := filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"], "greeting")
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		b, err := os.ReadFile(onDisk)
		return string(b) == "hello-dirpv\n", err
	})
	if err != nil {
		t.Fatalf("the pod's file is not in the volume directory %s: %v", onDisk, err)
	}
	target := volumeTarget(writer, pv.Name)
	if m := mountsUnder(t, target); len(m) != 1 {
		t.Errorf("mounts at the pod's volume target %s: %v, want exactly one", target, m)
	}

	deletePod(t, ns, "writer")
	waitNoMountsUnder(t, filepath.Dir(target))
	if _, err := os.Stat(target); !os.IsNotExist(err) {
		t.Errorf("target %s still exists after unpublish: %v", target, err)
	}

	suite.CreatePod(t, suite.BusyboxPod(ns, "reader", "data", `test "$(cat /data/greeting)" = hello-dirpv && echo read-ok`, false))
	waitPodPhase(t, ns, "reader", v1.PodSucceeded)
	if logs := podLogs(t, ns, "reader"); !strings.Contains(logs, "read-ok") {
		t.Errorf("reader pod logs %q, want read-ok", logs)
	}
}

// A pod that mounts its claim read-only cannot write to it.
func TestLocalReadOnlyMount(t *testing.T) {
	ns := suite.NewNamespace(t)
	base := filepath.Join(suite.Work.BaseRoot, "read-only")
	suite.CreateClass(t, "e2e-local-ro", map[string]string{"backend": "local", "basePath": base})
	suite.CreateClaim(t, ns, "data", "e2e-local-ro")
	suite.CreatePod(t, suite.BusyboxPod(ns, "ro", "data", `if touch /data/x 2>/dev/null; then echo wrote; exit 1; fi; echo refused`, true))
	waitPodPhase(t, ns, "ro", v1.PodSucceeded)
	pv := boundPV(t, ns, "data")
	// A missing directory would read as empty: require it to be there.
	if got, err := os.ReadDir(filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"])); err != nil || len(got) != 0 {
		t.Errorf("read-only pod's volume directory: %v %v, want it there and empty", got, err)
	}
}
