package provisioner

import (
	"context"
	"errors"
	"time"

	snapshotlisters "github.com/kubernetes-csi/external-snapshotter/client/v8/listers/volumesnapshot/v1"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
)

// operationBuckets span a local mkdir (milliseconds) to NFS calls near a long operation timeout.
var operationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120}

// instrumented is a Provisioner that records dirpv_provision_duration_seconds and
// dirpv_delete_duration_seconds. It embeds the Provisioner, so the lib still finds its
// Qualifier and DeletionGuard.
type instrumented struct {
	*Provisioner
	provision, delete *prometheus.HistogramVec
}

// Instrument registers dirpv's provisioning metrics on reg and returns p as the lib should call
// it, so that every Provision and Delete is counted and timed by backend and result.
func Instrument(p *Provisioner, reg prometheus.Registerer) controller.Provisioner {
	in := &instrumented{
		Provisioner: p,
		provision: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dirpv_provision_duration_seconds",
			Help:    "Time dirpv spent in Provision, by backend (nfs, local, unknown) and result (success, error, infeasible, in_background, reschedule). Its _count is the number of calls.",
			Buckets: operationBuckets,
		}, []string{"backend", "result"}),
		delete: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dirpv_delete_duration_seconds",
			Help:    "Time dirpv spent in Delete, by backend (nfs, local, unknown) and result (success, error, ignored). Its _count is the number of calls.",
			Buckets: operationBuckets,
		}, []string{"backend", "result"}),
	}
	reg.MustRegister(in.provision, in.delete, &exportsCollector{p: p}, &copiesCollector{p: p}, &escapesCollector{p: p})
	return in
}

// Provision calls the Provisioner's Provision and records its duration and outcome.
func (in *instrumented) Provision(ctx context.Context, opts controller.ProvisionOptions) (*v1.PersistentVolume, controller.ProvisioningState, error) {
	start := time.Now()
	pv, state, err := in.Provisioner.Provision(ctx, opts)
	backend := "unknown"
	if opts.StorageClass != nil {
		backend = volume.BackendLabel(volume.Backend(opts.StorageClass.Parameters[ParamBackend]))
	}
	in.provision.WithLabelValues(backend, provisionResult(state, err)).Observe(time.Since(start).Seconds())
	return pv, state, err
}

// provisionResult names an outcome the way the lib treats it.
func provisionResult(state controller.ProvisioningState, err error) string {
	if err == nil {
		return "success"
	}
	// The lib retries InvalidArgument only on its slow path: the claim cannot be served as is.
	if st, ok := status.FromError(err); ok && st.Code() == codes.InvalidArgument {
		return "infeasible"
	}
	switch state {
	case controller.ProvisioningInBackground:
		return "in_background"
	case controller.ProvisioningReschedule:
		return "reschedule"
	}
	return "error"
}

// Delete calls the Provisioner's Delete and records its duration and outcome.
func (in *instrumented) Delete(ctx context.Context, pv *v1.PersistentVolume) error {
	start := time.Now()
	err := in.Provisioner.Delete(ctx, pv)
	backend := "unknown"
	switch src := pv.Spec.PersistentVolumeSource; {
	case src.CSI != nil:
		backend = volume.BackendLabel(volume.Backend(src.CSI.VolumeAttributes[volume.AttrBackend]))
	case src.NFS != nil: // adopted
		backend = volume.BackendLabel(volume.BackendNFS)
	case src.HostPath != nil || src.Local != nil:
		backend = volume.BackendLabel(volume.BackendLocal)
	}
	result := "success"
	var ignored *controller.IgnoredError
	switch {
	case errors.As(err, &ignored):
		result = "ignored"
	case err != nil:
		result = "error"
	}
	in.delete.WithLabelValues(backend, result).Observe(time.Since(start).Seconds())
	return err
}

var (
	descStuckCalls = prometheus.NewDesc("dirpv_nfs_export_stuck_calls",
		"Calls on an NFS export whose callers gave up waiting for the server but that still run, by export (server:share).",
		[]string{"export"}, nil)
	descSaturated = prometheus.NewDesc("dirpv_nfs_export_saturated",
		"1 while every call slot of an NFS export is taken, so that new calls on it fail at once; 0 otherwise. By export (server:share).",
		[]string{"export"}, nil)
	descSaturatedSeconds = prometheus.NewDesc("dirpv_nfs_export_saturated_seconds",
		"How long every call slot of an NFS export has been taken with none coming free; 0 when not saturated. By export (server:share).",
		[]string{"export"}, nil)
	descMounted = prometheus.NewDesc("dirpv_nfs_exports_mounted",
		"NFS exports the controller has mounted under its work dir now.",
		nil, nil)
	descDeletesPending = prometheus.NewDesc("dirpv_nfs_deletes_pending",
		"Deleted NFS volumes whose trees are still being removed in the background (in .dirpv-trash).",
		nil, nil)
	descQuotaEscapes = prometheus.NewDesc("dirpv_quota_escapes",
		"What the last quota check of each of this node's limited local volumes found outside the volume's limit, summed, by kind of limit: "+
			"project (files and directories moved out of the volume's XFS or ext4 project quota, moved back since) and btrfs (nested subvolumes). 0 on a controller.",
		[]string{"kind"}, nil)
	descQuotaRepairs = prometheus.NewDesc("dirpv_quota_escape_repairs_total",
		"Files and directories this node's quota checks moved back into their volume's project quota.",
		nil, nil)
	descQuotaPasses = prometheus.NewDesc("dirpv_quota_checks_total",
		"Passes of this node's quota checks (--quota-check-period) that checked every limited local volume of the node.",
		nil, nil)
	descCopiesRunning = prometheus.NewDesc("dirpv_copies_running",
		"Copies (clones, restores, snapshots) running now, cancelled ones included until they have stopped and removed what they copied.",
		nil, nil)
	descCopiesWaiting = prometheus.NewDesc("dirpv_copies_waiting",
		"Copies (clones, restores, snapshots) waiting for a copy slot: one of the node's --max-local-copies, or of an NFS export's.",
		nil, nil)
	descCopiedFiles = prometheus.NewDesc("dirpv_copied_files_total",
		"Files of every kind (directories, symlinks and hard links included) that copies made, counted as they go.",
		nil, nil)
	descCopiedBytes = prometheus.NewDesc("dirpv_copied_bytes_total",
		"Bytes of file data that copies cloned or copied (holes left out), counted as they go.",
		nil, nil)
)

// exportsCollector reads the exports' state at scrape time, so there is no second copy of it
// to keep in step. Its label is server:share, without the mount options: mounts of one export
// with different options are summed, so the label set is that of the exports the NFS classes
// name, and it stays small. (Mount options are not secret: SECURITY.md.)
type exportsCollector struct{ p *Provisioner }

func (c *exportsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descStuckCalls
	ch <- descSaturated
	ch <- descSaturatedSeconds
	ch <- descMounted
	ch <- descDeletesPending
}

func (c *exportsCollector) Collect(ch chan<- prometheus.Metric) {
	if c.p.exports == nil {
		return
	}
	for _, st := range c.p.Exports() {
		saturated, seconds := 0.0, 0.0
		if st.Saturated {
			saturated, seconds = 1, time.Since(st.SaturatedSince).Seconds()
		}
		ch <- prometheus.MustNewConstMetric(descStuckCalls, prometheus.GaugeValue, float64(st.Stuck), st.Export)
		ch <- prometheus.MustNewConstMetric(descSaturated, prometheus.GaugeValue, saturated, st.Export)
		ch <- prometheus.MustNewConstMetric(descSaturatedSeconds, prometheus.GaugeValue, seconds, st.Export)
	}
	ch <- prometheus.MustNewConstMetric(descDeletesPending, prometheus.GaugeValue, float64(c.p.PendingDeletes()))
	// Left out if the mount table cannot be read: an invalid metric would fail the whole scrape.
	if n, err := c.p.exports.Mounted(); err == nil {
		ch <- prometheus.MustNewConstMetric(descMounted, prometheus.GaugeValue, float64(n))
	}
}

// copiesCollector reads the copies under way and what the process's copies made at scrape
// time, in either role.
type copiesCollector struct{ p *Provisioner }

func (c *copiesCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descCopiesRunning
	ch <- descCopiesWaiting
	ch <- descCopiedFiles
	ch <- descCopiedBytes
}

func (c *copiesCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(descCopiesRunning, prometheus.GaugeValue, float64(c.p.copying.running.Load()))
	ch <- prometheus.MustNewConstMetric(descCopiesWaiting, prometheus.GaugeValue, float64(c.p.copying.waiting.Load()))
	files, bytes := volume.CopyProgress()
	ch <- prometheus.MustNewConstMetric(descCopiedFiles, prometheus.CounterValue, float64(files))
	ch <- prometheus.MustNewConstMetric(descCopiedBytes, prometheus.CounterValue, float64(bytes))
}

// escapesCollector reads the node's quota check findings at scrape time.
type escapesCollector struct{ p *Provisioner }

func (c *escapesCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descQuotaEscapes
	ch <- descQuotaRepairs
	ch <- descQuotaPasses
}

func (c *escapesCollector) Collect(ch chan<- prometheus.Metric) {
	q := c.p.QuotaChecks()
	for kind, n := range q.Found {
		ch <- prometheus.MustNewConstMetric(descQuotaEscapes, prometheus.GaugeValue, float64(n), string(kind))
	}
	ch <- prometheus.MustNewConstMetric(descQuotaRepairs, prometheus.CounterValue, float64(q.Repaired))
	ch <- prometheus.MustNewConstMetric(descQuotaPasses, prometheus.CounterValue, float64(q.Passes))
}

var descSnapshotUsed = prometheus.NewDesc("dirpv_snapshot_used_bytes",
	"Space each ready snapshot this instance serves took when it was made: what its copy occupies "+
		"(st_blocks, hard links counted once), or for a btrfs snapshot the bytes it referenced, shared with its source until the source changes. "+
		"By the VolumeSnapshot's namespace and name and the VolumeSnapshotContent's name; a snapshot goes with its content.",
	[]string{"namespace", "volumesnapshot", "volumesnapshotcontent"}, nil)

// SnapshotsCollector reports dirpv_snapshot_used_bytes for the ready contents that contents
// lists (nil until the sidecar's informer runs) and s serves. One series per snapshot, as
// kubelet_volume_stats_* has one per claim; a deleted content's series goes with it. The
// sizes come from the snapshots' records, read when a snapshot is made and, for those made
// before this process started, looked up in the background after a scrape missed them.
func (s *Snapshotter) SnapshotsCollector(contents func() snapshotlisters.VolumeSnapshotContentLister) prometheus.Collector {
	return &snapshotsCollector{s: s, contents: contents}
}

type snapshotsCollector struct {
	s        *Snapshotter
	contents func() snapshotlisters.VolumeSnapshotContentLister
}

func (c *snapshotsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- descSnapshotUsed }

func (c *snapshotsCollector) Collect(ch chan<- prometheus.Metric) {
	lister := c.contents()
	if lister == nil {
		return
	}
	list, err := lister.List(labels.Everything())
	if err != nil {
		return
	}
	var missing []string
	for _, content := range list {
		st := content.Status
		if content.Spec.Driver != c.s.p.cfg.DriverName || st == nil || st.SnapshotHandle == nil || st.ReadyToUse == nil || !*st.ReadyToUse {
			continue
		}
		c.s.mu.Lock()
		size, ok := c.s.usage[*st.SnapshotHandle]
		c.s.mu.Unlock()
		if !ok {
			missing = append(missing, *st.SnapshotHandle)
			continue
		}
		ref := content.Spec.VolumeSnapshotRef
		ch <- prometheus.MustNewConstMetric(descSnapshotUsed, prometheus.GaugeValue, float64(size), ref.Namespace, ref.Name, content.Name)
	}
	if len(missing) > 0 {
		c.s.learnUsage(missing)
	}
}

// learnUsage reads the records of the snapshots ids in the background, unless a look-up runs
// already, so that the next scrape reports them. Handles another instance serves are skipped.
func (s *Snapshotter) learnUsage(ids []string) {
	if !s.learning.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer s.learning.Store(false)
		for _, id := range ids {
			h, err := volume.ParseSnapshotHandle(id)
			if err != nil || s.check(h) != nil {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), s.p.cfg.OperationTimeout)
			if _, _, err := s.status(ctx, h); err != nil {
				klog.Background().V(2).Info("Reading a snapshot's size for metrics", "snapshot", h.Name, "err", err)
			}
			cancel()
		}
	}()
}
