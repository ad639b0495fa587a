package provisioner

import (
	"context"
	"strings"
	"testing"

	"github.com/dirpv/dirpv/internal/metricstest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A real local provision and delete on a temp dir, a refused claim, and a PV of another
// backend are each counted once under their backend and result.
func TestProvisionMetricsLocal(t *testing.T) {
	f := newFixture(t)
	reg := prometheus.NewPedanticRegistry()
	p := Instrument(f.node, reg)
	class := f.localClass(nil)
	ctx := context.Background()

	pv, _, err := p.Provision(ctx, opts(class, claim("data")))
	must(t, err)
	block := claim("block")
	mode := v1.PersistentVolumeBlock
	block.Spec.VolumeMode = &mode
	if _, _, err := p.Provision(ctx, opts(class, block)); err == nil {
		t.Fatal("a Block claim was provisioned")
	}
	must(t, p.Delete(ctx, pv))
	nfsPV := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-nfs"}, Spec: v1.PersistentVolumeSpec{
		PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
			Driver: testDriver, VolumeAttributes: map[string]string{"backend": "nfs"}}}}}
	if err := p.Delete(ctx, nfsPV); err == nil {
		t.Fatal("a node instance deleted an NFS volume")
	}

	local := func(result string) map[string]string { return map[string]string{"backend": "local", "result": result} }
	if n := metricstest.HistogramCount(t, reg, "dirpv_provision_duration_seconds", local("success")); n != 1 {
		t.Errorf("successful local provisions: %d, want 1", n)
	}
	refused := metricstest.HistogramCount(t, reg, "dirpv_provision_duration_seconds", local("error")) +
		metricstest.HistogramCount(t, reg, "dirpv_provision_duration_seconds", local("infeasible"))
	if refused != 1 {
		t.Errorf("refused local provisions: %d, want 1", refused)
	}
	if n := metricstest.HistogramCount(t, reg, "dirpv_delete_duration_seconds", local("success")); n != 1 {
		t.Errorf("successful local deletes: %d, want 1", n)
	}
	if n := metricstest.HistogramCount(t, reg, "dirpv_delete_duration_seconds", map[string]string{"backend": "nfs", "result": "ignored"}); n != 1 {
		t.Errorf("ignored NFS deletes on a node: %d, want 1", n)
	}
	// A node has no NFS exports to report.
	if n := testutil.CollectAndCount(&exportsCollector{p: f.node}); n != 0 {
		t.Errorf("node instance reports %d export metrics, want none", n)
	}
}

// After an NFS provision the controller reports one mounted export, nothing stuck, labelled
// server:share only: mount options, which may carry credentials, never reach a label.
func TestExportMetrics(t *testing.T) {
	f := newFixture(t)
	reg := prometheus.NewPedanticRegistry()
	p := Instrument(f.ctrl, reg)
	class := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "nfs"}, Provisioner: testDriver,
		Parameters:   map[string]string{"backend": "nfs", "server": "127.0.0.1", "share": "/export"},
		MountOptions: []string{"vers=4.1", "sec=sys,secret-token=hunter2"}}
	f.classes.Add(class)
	c := claim("shared", v1.ReadWriteMany)
	delete(c.Annotations, annSelectedNode)
	_, _, err := p.Provision(context.Background(), opts(class, c))
	must(t, err)
	if n := metricstest.HistogramCount(t, reg, "dirpv_provision_duration_seconds", map[string]string{"backend": "nfs", "result": "success"}); n != 1 {
		t.Errorf("successful NFS provisions: %d, want 1", n)
	}
	want := `
# HELP dirpv_nfs_export_saturated 1 while every call slot of an NFS export is taken, so that new calls on it fail at once; 0 otherwise. By export (server:share).
# TYPE dirpv_nfs_export_saturated gauge
dirpv_nfs_export_saturated{export="127.0.0.1:/export"} 0
# HELP dirpv_nfs_export_stuck_calls Calls on an NFS export whose callers gave up waiting for the server but that still run, by export (server:share).
# TYPE dirpv_nfs_export_stuck_calls gauge
dirpv_nfs_export_stuck_calls{export="127.0.0.1:/export"} 0
# HELP dirpv_nfs_exports_mounted NFS exports the controller has mounted under its work dir now.
# TYPE dirpv_nfs_exports_mounted gauge
dirpv_nfs_exports_mounted 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"dirpv_nfs_export_saturated", "dirpv_nfs_export_stuck_calls", "dirpv_nfs_exports_mounted"); err != nil {
		t.Error(err)
	}
	mfs, err := reg.Gather()
	must(t, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if strings.Contains(l.GetValue(), "hunter2") {
					t.Errorf("%s carries a mount option in label %s=%q", mf.GetName(), l.GetName(), l.GetValue())
				}
			}
		}
	}
}
