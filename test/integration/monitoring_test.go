package integration

import (
	"context"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/framework"
)

// TestMonitoringMetricsAreServed: every dirpv metric that deploy/components/monitoring's
// dashboard panels, variables and alerts name is on the /metrics of the controller or of the
// node instance, once they have done what it counts: an NFS claim and a local claim provisioned
// and deleted, and the local volume published and unpublished through node-a's CSI socket as
// kubelet would. Only deploy.ExternalMetrics (kubelet's, kube-state-metrics') are left out.
func TestMonitoringMetricsAreServed(t *testing.T) {
	exprs, err := deploy.MonitoringExprs(framework.RepoRoot())
	must(t, err)
	ns := suite.NewNamespace(t)
	nfs := nfsClass(t, suite.NFS, []string{"nolock"}, nil)
	// Not localClass: its name, as nfsClass's, is the test's.
	local := suite.CreateClass(t, "monitoring-local", map[string]string{"backend": "local", "basePath": filepath.Join(suite.Work.BaseRoot, "monitoring-local")})
	suite.CreateClaim(t, ns, "nfs", nfs.Name)
	suite.CreateClaim(t, ns, "local", local.Name, framework.OnNode(nodeA))
	_, nfsPV := waitBound(t, ns, "nfs")
	_, localPV := waitBound(t, ns, "local")

	node := nodeAClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	target := filepath.Join(t.TempDir(), "target")
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: localPV.Spec.CSI.VolumeHandle, TargetPath: target, VolumeContext: localPV.Spec.CSI.VolumeAttributes,
		VolumeCapability: mountRWO,
	}); err != nil {
		t.Fatalf("publish %s: %v", localPV.Name, err)
	}
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: localPV.Spec.CSI.VolumeHandle, TargetPath: target}); err != nil {
		t.Fatalf("unpublish %s: %v", localPV.Name, err)
	}
	deleteClaim(t, ns, "nfs")
	deleteClaim(t, ns, "local")
	waitPVGone(t, nfsPV.Name)
	waitPVGone(t, localPV.Name)

	served := map[string]bool{}
	for _, p := range []*framework.Process{ctrlProc, nodeProc} {
		m, err := framework.Scrape(context.Background(), p)
		must(t, err)
		for series := range m {
			name, _, _ := strings.Cut(series, "{")
			served[name] = true
		}
	}
	checked := 0
	for _, where := range slices.Sorted(maps.Keys(exprs)) {
		for _, name := range deploy.MetricNames(exprs[where]) {
			if _, ok := deploy.ExternalMetrics[name]; ok {
				continue
			}
			checked++
			if !served[name] {
				t.Errorf("%s names %s, which neither the controller nor the node serves (expression %q)", where, name, exprs[where])
			}
		}
	}
	if checked == 0 {
		t.Fatal("the dashboard and the alerts name no dirpv metric")
	}
}
