package provisioner

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kubernetes-csi/external-snapshotter/v8/pkg/snapshotter"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume"
)

// Snapshotter is external-snapshotter's snapshotter.Snapshotter over the Provisioner's
// volumes: its sidecar controller, run in-process, calls it where it would call a CSI
// driver's CreateSnapshot, DeleteSnapshot and ListSnapshots. The controller's instance
// snapshots NFS volumes, each node's instance the local volumes on that node.
//
// A copy can take longer than the sidecar waits for one call, so CreateSnapshot starts it in
// the background and answers "not ready"; the sidecar calls again (with backoff) until the
// copy is complete and the answer is ready. A copy cut short (a crash, a deadline) leaves no
// snapshot: the next CreateSnapshot starts it again.
type Snapshotter struct {
	p   *Provisioner
	pvs corelisters.PersistentVolumeLister

	mu   sync.Mutex
	jobs map[string]*snapshotJob // by snapshot handle
	// ctx is the parent of the background copies; nil but between Start and its end.
	ctx     context.Context
	running sync.WaitGroup
	// noRoomRetryMin and noRoomRetryMax bound the back-off of a copy that was not started
	// for lack of space.
	noRoomRetryMin, noRoomRetryMax time.Duration
	// usage is the size of each complete snapshot seen, by handle (dirpv_snapshot_used_bytes).
	usage map[string]uint64
	// learning is set while a look-up of the sizes metrics miss runs (learnUsage).
	learning atomic.Bool
	// spaceChanged, if set, is called once a copy took space on a store or a deletion gave
	// some back, for the published capacity to follow at once (SetSpaceChanged).
	spaceChanged func()
}

// SnapshotNamePrefix is the sidecar's --snapshot-name-prefix, as dirpv runs it: a snapshot
// is named SnapshotNamePrefix-<VolumeSnapshot UID>.
const SnapshotNamePrefix = "snapshot"

// The snapshot API's kinds, for events.
const (
	snapshotAPIVersion = "snapshot.storage.k8s.io/v1"
	kindContent        = "VolumeSnapshotContent"
)

// The back-off of a snapshot whose copy the base has no room for: the sidecar asks again
// within seconds (it polls copies under way), and each answer that started the check again
// would walk the source again.
const (
	noRoomRetryMin = 15 * time.Second
	noRoomRetryMax = 5 * time.Minute
)

// snapshotJob is one background copy.
type snapshotJob struct {
	done   chan struct{}
	cancel context.CancelFunc
	err    error // once done
	// noRoom counts the copies of this snapshot in a row not started for lack of space, this
	// one included if it was not; retryAt is when the next may start (zero: at once).
	noRoom  int
	retryAt time.Time
}

var _ snapshotter.Snapshotter = (*Snapshotter)(nil)

// Snapshotter returns the Provisioner's Snapshotter. It reads source volumes from pvs; each
// copy is bounded by Config.CloneTimeout. Start it, then hand it to the sidecar controller.
func (p *Provisioner) Snapshotter(pvs corelisters.PersistentVolumeLister) *Snapshotter {
	return &Snapshotter{p: p, pvs: pvs, jobs: map[string]*snapshotJob{}, noRoomRetryMin: noRoomRetryMin, noRoomRetryMax: noRoomRetryMax,
		usage: map[string]uint64{}}
}

// SetSpaceChanged has fn called whenever a snapshot's copy ended (a complete copy took space;
// a failed one gave it back) or a snapshot was deleted: the capacity published for the store
// is then refreshed at once, as after a Provision or Delete, not at the next poll. Call it
// before Start.
func (s *Snapshotter) SetSpaceChanged(fn func()) { s.spaceChanged = fn }

// changedSpace calls spaceChanged, if set.
func (s *Snapshotter) changedSpace() {
	if s.spaceChanged != nil {
		s.spaceChanged()
	}
}

// Start lets copies start until ctx is done. The function it returns waits for that, then
// stops the copies still running and returns once they have: their snapshots are left
// incomplete, and made again by the next process.
func (s *Snapshotter) Start(ctx context.Context) (wait func()) {
	copies, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.mu.Lock()
	s.ctx = copies
	s.mu.Unlock()
	return func() {
		<-ctx.Done()
		s.mu.Lock()
		s.ctx = nil
		s.mu.Unlock()
		stop()
		s.running.Wait()
	}
}

// CreateSnapshot snapshots the volume of volumeHandle as snapshotName, the sidecar's name
// (prefix and the VolumeSnapshot's UID), so that every call for one VolumeSnapshot means the
// same snapshot. readyToUse is false while the copy runs.
func (s *Snapshotter) CreateSnapshot(ctx context.Context, snapshotName, volumeHandle string, parameters, _ map[string]string) (string, string, time.Time, int64, bool, error) {
	fail := func(err error) (string, string, time.Time, int64, bool, error) {
		return "", "", time.Time{}, 0, false, err
	}
	if len(parameters) > 0 {
		keys := make([]string, 0, len(parameters))
		for k := range parameters {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		return fail(invalid(fmt.Errorf("VolumeSnapshotClass parameters %s are not known: dirpv snapshot classes take none", volume.QuoteList(keys))))
	}
	pv, attrs, err := s.source(ctx, volumeHandle)
	if err != nil {
		return fail(err)
	}
	q := pv.Spec.Capacity[v1.ResourceStorage]
	h := volume.SnapshotHandle{
		Backend: attrs.Backend, Server: attrs.Server, Share: attrs.Share, BasePath: attrs.BasePath,
		Name: snapshotName, Size: q.Value(),
	}
	if attrs.Backend == volume.BackendNFS {
		h.MountOptions = pv.Spec.MountOptions
	} else {
		h.Node = s.p.cfg.NodeName
	}
	if err := h.Validate(); err != nil {
		return fail(invalid(fmt.Errorf("snapshot of PV %s: %w", pv.Name, err)))
	}
	id := h.String()
	ready, created, err := s.status(ctx, h)
	if ready {
		// The sidecar asks no more once told ready: this is the last look at the job.
		s.forget(id)
	}
	if err != nil || ready {
		return s.p.cfg.DriverName, id, created, h.Size, ready, err
	}
	if err := s.start(ctx, id, h, attrs.Path, pv.Spec.ClaimRef); err != nil {
		return fail(err)
	}
	return s.p.cfg.DriverName, id, time.Now(), h.Size, false, nil
}

// distributedHint is why the controller's sidecar is asked about a local volume's snapshot:
// the common snapshot controller labels the content of a local volume with its node, so
// that the node's sidecar takes it and the controller's does not, only when it runs with
// --enable-distributed-snapshotting.
const distributedHint = "the snapshot controller must run with --enable-distributed-snapshotting (dirpv's snapshot component sets it) for the node to take it"

// source returns the PV of a dirpv volume handle that this instance snapshots, and its
// attributes.
func (s *Snapshotter) source(ctx context.Context, volumeHandle string) (*v1.PersistentVolume, volume.Attributes, error) {
	_, pvName, ok := strings.Cut(volumeHandle, ":")
	if !ok || pvName == "" {
		return nil, volume.Attributes{}, invalid(fmt.Errorf("volume handle %s is not one of %s's", volume.Quote(volumeHandle), s.p.cfg.DriverName))
	}
	pv, err := s.pvs.Get(pvName)
	if err != nil {
		return nil, volume.Attributes{}, fmt.Errorf("source volume %s: %w", pvName, err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != s.p.cfg.DriverName || pv.Spec.CSI.VolumeHandle != volumeHandle {
		return nil, volume.Attributes{}, invalid(fmt.Errorf("PV %s is not the %s volume %s", pvName, s.p.cfg.DriverName, volume.Quote(volumeHandle)))
	}
	if s.p.cfg.Role == RoleController && volume.Backend(pv.Spec.CSI.VolumeAttributes[volume.AttrBackend]) == volume.BackendLocal {
		return nil, volume.Attributes{}, fmt.Errorf("PV %s is a local volume, snapshotted on its node, not by the controller: %s", pvName, distributedHint)
	}
	if why := s.p.responsibleFor(ctx, pv); why != "" {
		return nil, volume.Attributes{}, fmt.Errorf("not snapshotted here: %s", why)
	}
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	if err != nil {
		return nil, volume.Attributes{}, invalid(fmt.Errorf("PV %s: %w", pvName, err))
	}
	return pv, attrs, nil
}

// start starts the copy of rel into h unless it is running already, and returns the error
// of the last copy of h if that one failed (once: the next call starts it again). A copy the
// base had no room for is not started again before its back-off has passed; the source's
// claim, claimRef, is told.
func (s *Snapshotter) start(ctx context.Context, id string, h volume.SnapshotHandle, rel string, claimRef *v1.ObjectReference) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	noRoom := 0
	if job, ok := s.jobs[id]; ok {
		select {
		case <-job.done:
			if time.Now().Before(job.retryAt) {
				return job.err
			}
			delete(s.jobs, id)
			if job.noRoom == 0 && job.err != nil {
				return job.err
			}
			if job.err == nil {
				// Done since status looked: the next call reports it ready.
				return nil
			}
			noRoom = job.noRoom
		default:
			return nil
		}
	}
	if s.ctx == nil {
		return fmt.Errorf("snapshot %s: shutting down", h.Name)
	}
	copyCtx, cancel := context.WithTimeout(s.ctx, s.p.cfg.CloneTimeout)
	copyCtx = klog.NewContext(copyCtx, klog.FromContext(ctx).WithValues("snapshot", h.Name, "path", rel))
	job := &snapshotJob{done: make(chan struct{}), cancel: cancel}
	s.jobs[id] = job
	s.running.Add(1)
	go func() {
		defer s.running.Done()
		defer cancel()
		defer close(job.done)
		start := time.Now()
		watch := &copyWatch{what: fmt.Sprintf("volume %s into snapshot %s", rel, h.Name),
			more: func(ctx context.Context) []*v1.ObjectReference { return s.snapshotObjects(ctx, h.Name) }}
		var source *v1.ObjectReference
		if claimRef != nil {
			source = &v1.ObjectReference{Kind: kindPVC, APIVersion: "v1", Namespace: claimRef.Namespace, Name: claimRef.Name, UID: claimRef.UID}
			watch.what = fmt.Sprintf("%s %s/%s into snapshot %s", kindPVC, claimRef.Namespace, claimRef.Name, h.Name)
			watch.to = append(watch.to, source)
		}
		// Through onStores, as a clone's copy: on NFS under the copy's deadline rather than
		// the operation timeout.
		store := h.Store(rel)
		err := s.p.onStores(copyCtx, store, h.MountOptions, &sourceTree{attrs: store, mountOptions: h.MountOptions, watch: watch},
			func(ctx context.Context, root, _ *volume.Root) error {
				// A copy is held under the source's size where the base enforces limits. On NFS a
				// failed copy is left for the next attempt, or the delete's trash, to remove.
				_, err := root.Snapshot(ctx, rel, h.Name, volume.SnapshotOptions{Margin: s.p.cfg.CopySpaceMargin,
					Limit: uint64(max(h.Size, 0)), KeepFailed: h.Backend == volume.BackendNFS})
				return err
			})
		if errors.Is(err, volume.ErrNoRoomForCopy) {
			job.noRoom = noRoom + 1
			wait := min(s.noRoomRetryMin<<min(job.noRoom-1, 20), s.noRoomRetryMax)
			job.retryAt = time.Now().Add(wait)
			job.err = fmt.Errorf("snapshot %s of %s in %s not started: %w; trying again in %v", h.Name, rel, storeName(h.Store(rel)), err, wait)
			klog.FromContext(copyCtx).Info("Snapshot not started: no room for its copy", "reason", err.Error(), "retryIn", wait)
			if s.p.cfg.Events != nil && source != nil {
				s.p.cfg.Events.Event(source, v1.EventTypeWarning, ReasonNoRoomForCopy, job.err.Error())
			}
			return
		}
		// Whether it failed or not, the copy changed the store's free space.
		defer s.changedSpace()
		if err != nil {
			job.err = fmt.Errorf("snapshot of %s in %s: %w", rel, storeName(h.Store(rel)), err)
			klog.FromContext(copyCtx).Error(err, "Snapshot failed")
			return
		}
		klog.FromContext(copyCtx).Info("Snapshot complete", "duration", time.Since(start))
	}()
	return nil
}

// status says whether h's snapshot is complete, and when it was taken.
func (s *Snapshotter) status(ctx context.Context, h volume.SnapshotHandle) (ready bool, created time.Time, err error) {
	if err := s.check(h); err != nil {
		return false, time.Time{}, err
	}
	err = s.p.onStore(ctx, h.Store(h.Name), h.MountOptions, func(root *volume.Root) error {
		info, err := root.SnapshotInfo(h.Name)
		if err != nil {
			return err
		}
		ready, created = true, info.CreatedAt
		s.mu.Lock()
		s.usage[h.String()] = info.Size
		s.mu.Unlock()
		return nil
	})
	if isNotExist(err) {
		return false, time.Time{}, nil
	}
	if err != nil {
		return false, time.Time{}, fmt.Errorf("snapshot %s in %s: %w", h.Name, storeName(h.Store(h.Name)), err)
	}
	return ready, created, nil
}

// check refuses handles another instance serves, and NFS exports no dirpv class names: a
// handle (a pre-provisioned content's) or a PV can name any server, and the controller
// mounts only those its classes name, as for clones.
func (s *Snapshotter) check(h volume.SnapshotHandle) error {
	switch {
	case s.p.cfg.Role == RoleController && h.Backend != volume.BackendNFS:
		return fmt.Errorf("snapshot %s is a local one, handled on node %q: %s", h.Name, h.Node, distributedHint)
	case s.p.cfg.Role == RoleNode && h.Node != s.p.cfg.NodeName:
		return fmt.Errorf("snapshot %s lives on node %q, not on %q", h.Name, h.Node, s.p.cfg.NodeName)
	case h.Backend == volume.BackendNFS && !s.p.servesExport(h.Server, h.Share):
		return invalid(fmt.Errorf("snapshot %s is on NFS export %s, which no dirpv NFS StorageClass names", h.Name, volume.ExportSource(h.Server, h.Share)))
	}
	return nil
}

// DeleteSnapshot removes the snapshot, stopping its copy first if one runs. A snapshot that is
// gone already counts as deleted.
func (s *Snapshotter) DeleteSnapshot(ctx context.Context, snapshotID string, _ map[string]string) error {
	h, err := volume.ParseSnapshotHandle(snapshotID)
	if err != nil {
		return invalid(err)
	}
	if err := s.check(h); err != nil {
		return err
	}
	s.mu.Lock()
	job, ok := s.jobs[snapshotID]
	delete(s.jobs, snapshotID)
	delete(s.usage, snapshotID)
	s.mu.Unlock()
	if ok {
		job.cancel()
		select {
		case <-job.done:
		case <-ctx.Done():
			return fmt.Errorf("snapshot %s: waiting for its copy to stop: %w", h.Name, ctx.Err())
		}
	}
	if h.Backend == volume.BackendNFS && s.p.exports != nil {
		// As for a volume's Delete: only the move to the trash is bounded by the operation
		// timeout, the removal of the tree goes on in the background.
		err = s.p.exports.TrashSnapshot(ctx, h.Server, h.Share, h.MountOptions, h.Name)
	} else {
		err = s.p.onStore(ctx, h.Store(h.Name), h.MountOptions, func(root *volume.Root) error {
			return root.DeleteSnapshot(h.Name)
		})
	}
	if err != nil && !isNotExist(err) {
		return fmt.Errorf("delete snapshot %s in %s: %w", h.Name, storeName(h.Store(h.Name)), err)
	}
	klog.FromContext(ctx).Info("Deleted snapshot", "snapshot", h.Name, "store", storeName(h.Store(h.Name)))
	s.changedSpace()
	return nil
}

// snapshotObjects returns the references of the VolumeSnapshotContent and VolumeSnapshot of
// the snapshot name, which the sidecar named after the VolumeSnapshot's UID; the common
// controller names a dynamic snapshot's content after it too. None if they cannot be read:
// the events then go on the source claim only.
func (s *Snapshotter) snapshotObjects(ctx context.Context, name string) []*v1.ObjectReference {
	uid, ok := strings.CutPrefix(name, SnapshotNamePrefix+"-")
	if !ok || s.p.cfg.Snapshots == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	c, err := s.p.cfg.Snapshots.SnapshotV1().VolumeSnapshotContents().Get(ctx, "snapcontent-"+uid, metav1.GetOptions{})
	if err != nil || string(c.Spec.VolumeSnapshotRef.UID) != uid {
		klog.FromContext(ctx).V(2).Info("No VolumeSnapshotContent to report the snapshot's copy on", "err", err)
		return nil
	}
	ref := c.Spec.VolumeSnapshotRef
	return []*v1.ObjectReference{
		{Kind: kindContent, APIVersion: snapshotAPIVersion, Name: c.Name, UID: c.UID},
		{Kind: kindVolumeSnapshot.kind, APIVersion: snapshotAPIVersion, Namespace: ref.Namespace, Name: ref.Name, UID: ref.UID},
	}
}

// GetSnapshotStatus reports a snapshot the sidecar did not create (a pre-provisioned
// VolumeSnapshotContent naming a handle): ready once complete; its size is the handle's.
func (s *Snapshotter) GetSnapshotStatus(ctx context.Context, snapshotID string, _ map[string]string) (bool, time.Time, int64, string, error) {
	h, err := volume.ParseSnapshotHandle(snapshotID)
	if err != nil {
		return false, time.Time{}, 0, "", invalid(err)
	}
	ready, created, err := s.status(ctx, h)
	if err == nil && !ready && !s.copying(snapshotID) {
		err = fmt.Errorf("snapshot %s does not exist in %s", h.Name, storeName(h.Store(h.Name)))
	}
	return ready, created, h.Size, "", err
}

// forget drops the job of snapshot id, complete: the job would otherwise stay until the
// snapshot is deleted. Its goroutine, if it has not returned yet, is past the copy (the
// snapshot is complete once the copy is) and still counted in running.
func (s *Snapshotter) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.jobs, id)
}

// copying reports whether the copy of id runs: a finished one says nothing about whether
// its snapshot is still there.
func (s *Snapshotter) copying(id string) bool {
	s.mu.Lock()
	job, ok := s.jobs[id]
	s.mu.Unlock()
	if !ok {
		return false
	}
	select {
	case <-job.done:
		return false
	default:
		return true
	}
}
