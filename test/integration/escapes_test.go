package integration

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// quotaCheckPeriod is node-a's --quota-check-period.
const quotaCheckPeriod = 2 * time.Second

// asTenant runs script with sh in dir as UID and GID 1000, no supplementary groups and no
// capabilities, as an ordinary pod's process would.
func asTenant(t *testing.T, dir, script string) {
	t.Helper()
	cmd := exec.Command("setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--inh-caps=-all", "sh", "-c", script)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("tenant's %q: %v\n%s", script, err, out)
	}
}

// quotaMetrics scrapes node-a's quota check metrics: completed passes and btrfs findings.
func quotaMetrics(ctx context.Context, t *testing.T) (passes, btrfs float64) {
	t.Helper()
	m, err := framework.Scrape(ctx, nodeProc)
	must(t, err)
	return m["dirpv_quota_checks_total"], m[`dirpv_quota_escapes{kind="btrfs"}`]
}

// waitPasses waits until node-a has completed n more quota check passes than it had at from.
func waitPasses(ctx context.Context, t *testing.T, from float64, n int) {
	t.Helper()
	err := framework.Poll(ctx, 10*quotaCheckPeriod+timeout, func(ctx context.Context) (bool, error) {
		p, _ := quotaMetrics(ctx, t)
		return p >= from+float64(n), fmt.Errorf("%v quota check passes, want %v", p, from+float64(n))
	})
	must(t, err)
}

// escapeEvents lists the QuotaEscape events on the claim.
func escapeEvents(ctx context.Context, t *testing.T, ns, claim string) []v1.Event {
	t.Helper()
	sel := fields.Set{"involvedObject.kind": "PersistentVolumeClaim", "involvedObject.name": claim, "reason": provisioner.ReasonQuotaEscape}
	evs, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: sel.AsSelector().String()})
	must(t, err)
	return evs.Items
}

// A tenant of a 16Mi claim on btrfs with quota (UID 1000, no capability) makes a subvolume in
// a directory of its volume, which the volume's qgroup does not count. node-a's periodic quota
// check tells the claim: a Warning QuotaEscape event naming one nested subvolume and its path
// in the volume, quoted. Further passes with nothing new add no event (the event's count stays
// 1). A second subvolume is a new finding, with an event of its own, and the metric counts
// both; once the claim and its volume are deleted, it counts none.
func TestNestedSubvolumeIsReported(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, base, _ := btrfsClass(t, map[string]string{"capacityEnforcement": "required", "uid": "1000", "gid": "1000"})
	suite.CreateClaim(t, ns, "data", class, framework.OnNode(nodeA), framework.Request("16Mi"))
	_, pv := waitBound(t, ns, "data")
	if !strings.HasPrefix(pv.Spec.CSI.VolumeAttributes["quota"], "btrfs/") {
		t.Fatalf("PV attributes %v name no btrfs qgroup", pv.Spec.CSI.VolumeAttributes)
	}
	vol := filepath.Join(base, pv.Spec.CSI.VolumeAttributes["path"])
	asTenant(t, vol, "mkdir d && btrfs subvolume create d/sub")

	ev, err := framework.WaitForEvent(ctx, suite.Client, ns, "PersistentVolumeClaim", "data", provisioner.ReasonQuotaEscape,
		`holds 1 nested btrfs subvolume(s), e.g. "d/sub"`, 10*quotaCheckPeriod+timeout)
	must(t, err, nodeProc)
	if ev.Type != v1.EventTypeWarning {
		t.Errorf("event %s: %s, want a Warning", ev.Type, ev.Message)
	}
	t.Logf("event: %s", ev.Message)
	passes, found := quotaMetrics(ctx, t)
	if found < 1 {
		t.Errorf("dirpv_quota_escapes{kind=\"btrfs\"} is %v after the event, want at least 1", found)
	}
	// Nothing new: passes go by without another event.
	waitPasses(ctx, t, passes, 2)
	if evs := escapeEvents(ctx, t, ns, "data"); len(evs) != 1 || evs[0].Count > 1 {
		t.Errorf("after more passes with the same finding: %d QuotaEscape events (first count %d), want the one, count 1", len(evs), evs[0].Count)
	}

	asTenant(t, vol, "btrfs subvolume create other")
	_, err = framework.WaitForEvent(ctx, suite.Client, ns, "PersistentVolumeClaim", "data", provisioner.ReasonQuotaEscape,
		"holds 2 nested btrfs subvolume(s)", 10*quotaCheckPeriod+timeout)
	must(t, err, nodeProc)
	if _, found := quotaMetrics(ctx, t); found != 2 {
		t.Errorf("dirpv_quota_escapes{kind=\"btrfs\"} is %v with the claim's two nested subvolumes, want 2", found)
	}

	deleteClaim(t, ns, "data")
	waitPVGone(t, pv.Name)
	passes, _ = quotaMetrics(ctx, t)
	waitPasses(ctx, t, passes, 1)
	if _, found := quotaMetrics(ctx, t); found != 0 {
		t.Errorf("dirpv_quota_escapes{kind=\"btrfs\"} is %v once the volume is gone, want 0", found)
	}
}
