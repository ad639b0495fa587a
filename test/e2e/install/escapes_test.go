package install

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// quotaCheckPeriod is the installed node plugin's --quota-check-period (TestMain).
const quotaCheckPeriod = 5 * time.Second

// A tenant pod of a 16Mi claim on the btrfs base (UID 1000, no capabilities, no privilege
// escalation) creates a subvolume inside its volume, as `btrfs subvolume create` does, and
// writes 32Mi into it: the kernel allows both, and the volume's qgroup does not count a
// nested subvolume, so the claim's size does not hold against it. What dirpv does about it
// is tell: the node's quota check puts a Warning QuotaEscape event on the claim naming the
// subvolume. Deleting the claim removes the volume, nested subvolume and all.
func TestPodNestedSubvolumeIsReported(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	suite.CreateClass(t, "install-subvolume", map[string]string{"backend": "local", "basePath": btrfsBase,
		"capacityEnforcement": "required", "uid": "1000", "gid": "1000"})
	suite.CreateClaim(t, ns, "data", "install-subvolume", framework.Request("16Mi"))

	tools := filepath.Join(suite.Work.Dir, "tenant-tool")
	must(t, os.MkdirAll(tools, 0o755))
	must(t, framework.BuildTenantTool(ctx, tools))
	pod := suite.BusyboxPod(ns, "tenant", "data", `T=/tools/tenant
mkdir /data/d; echo "subvolume: $($T subvolume /data/d/sub)"
dd if=/dev/zero of=/data/d/sub/big bs=1M count=32 conv=fsync 2>&1; echo "dd exit $?"`, false)
	pod.Spec.Containers[0].SecurityContext = &v1.SecurityContext{
		RunAsUser: ptr.To[int64](1000), RunAsGroup: ptr.To[int64](1000), RunAsNonRoot: ptr.To(true),
		AllowPrivilegeEscalation: ptr.To(false),
		Capabilities:             &v1.Capabilities{Drop: []v1.Capability{"ALL"}},
	}
	suite.CreatePod(t, framework.WithTenantTool(pod, tools))
	logs := podDone(t, ns, "tenant")
	t.Logf("tenant pod:\n%s", logs)
	if !strings.Contains(logs, "subvolume: ok") {
		t.Fatalf("the tenant pod could not create a subvolume in its volume: %q; the kernel allowed it when this test was written", logs)
	}
	dir := volumeDir(t, ns, "data")
	st, err := os.Stat(filepath.Join(dir, "d/sub/big"))
	if !strings.Contains(logs, "dd exit 0") || err != nil || st.Size() != 32<<20 {
		t.Errorf("writing 32Mi into a nested subvolume of a 16Mi claim: pod printed %q, file %v (%v); want all 32Mi written (the escape this test measures)", logs, st, err)
	}

	ev, err := framework.WaitForEvent(ctx, suite.Client, ns, "PersistentVolumeClaim", "data", provisioner.ReasonQuotaEscape,
		`holds 1 nested btrfs subvolume(s), e.g. "d/sub"`, 10*quotaCheckPeriod+timeout)
	must(t, err)
	if ev.Type != v1.EventTypeWarning {
		t.Errorf("event %s: %s, want a Warning", ev.Type, ev.Message)
	}
	t.Logf("event: %s", ev.Message)

	deletePodAndClaim(t, ns, "tenant", "data")
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("volume %s with its nested subvolume after the claim's delete: %v, want it gone", dir, err)
	}
}
