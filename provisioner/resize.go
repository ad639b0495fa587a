package provisioner

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kubernetes-csi/external-resizer/pkg/resizer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume"
)

// Resizer is the external-resizer controller's resizer.Resizer for the volumes this
// Provisioner serves: local volumes on their own node, whose limit it raises in place, and
// NFS volumes in the controller, whose new size is recorded only (a client cannot set the
// server's quotas). No volume needs a file system resize on its node: a limit holds as soon as
// it is set.
//
// The controller decides what to do next from the error's gRPC status (its util.IsFinalError
// and IsInfeasibleError): a refusal no retry of the same size can fix is OutOfRange or
// InvalidArgument (the claim gets ControllerResizeInfeasible, and a smaller request that fits
// is accepted), a volume that is not the claim's is FailedPrecondition; anything else is a
// plain error, which the controller retries.
type Resizer struct {
	p *Provisioner
	// ctx carries the logger and ends with the process; the lib's Resize takes no context.
	ctx context.Context

	mu       sync.Mutex
	draining bool
	inflight sync.WaitGroup
}

var _ resizer.Resizer = (*Resizer)(nil)

// Resizer returns the resizer of the volumes p serves. ctx bounds every resize.
func (p *Provisioner) Resizer(ctx context.Context) *Resizer {
	return &Resizer{p: p, ctx: ctx}
}

// Name is the CSI driver name, which the controller names its queue and events after.
func (r *Resizer) Name() string { return r.p.cfg.DriverName }

// DriverSupportsControlPlaneExpansion is true: the whole resize happens here.
func (r *Resizer) DriverSupportsControlPlaneExpansion() bool { return true }

// CanSupport says whether this instance resizes the PV: a local volume on the node instance
// it lives on, within that node's allowed bases, and an NFS volume in the controller. Every
// other instance sees the same claims and must leave them alone.
func (r *Resizer) CanSupport(pv *v1.PersistentVolume, _ *v1.PersistentVolumeClaim) bool {
	return r.resizableHere(pv) == nil
}

func (r *Resizer) resizableHere(pv *v1.PersistentVolume) error {
	cfg := r.p.cfg
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != cfg.DriverName {
		return fmt.Errorf("PV %s is not a %s volume", pv.Name, cfg.DriverName)
	}
	attrs := pv.Spec.CSI.VolumeAttributes
	local := volume.Backend(attrs[volume.AttrBackend]) == volume.BackendLocal
	switch {
	case pv.Status.Phase != v1.VolumeBound:
		// A Released volume may be being deleted: a late resize must not set a limit again
		// on a volume whose limit the removal has just cleared.
		return fmt.Errorf("PV %s is %s, not Bound", pv.Name, pv.Status.Phase)
	case cfg.Role == RoleController && local:
		return fmt.Errorf("PV %s is a local volume, resized on its node", pv.Name)
	case cfg.Role == RoleNode && !local:
		return fmt.Errorf("PV %s is not a local volume, resized by the controller", pv.Name)
	case cfg.Role == RoleNode && pv.Annotations[AnnNode] != cfg.NodeName:
		return fmt.Errorf("PV %s lives on node %q, not on %q", pv.Name, pv.Annotations[AnnNode], cfg.NodeName)
	case cfg.Role == RoleNode:
		if _, _, err := cfg.AllowedBases.Locate(attrs[volume.AttrBasePath], attrs[volume.AttrPath]); err != nil {
			return fmt.Errorf("PV %s: %w", pv.Name, err)
		}
	}
	return nil
}

// Drain refuses new resizes and waits for those in flight, so that the bases and mounts they
// use can be closed.
func (r *Resizer) Drain() {
	r.mu.Lock()
	r.draining = true
	r.mu.Unlock()
	r.inflight.Wait()
}

// enter counts a resize in, unless Drain has begun.
func (r *Resizer) enter() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.draining {
		return false
	}
	r.inflight.Add(1)
	return true
}

// Resize gives the PV's volume the size requested and returns it as the PV's new capacity.
func (r *Resizer) Resize(pv *v1.PersistentVolume, size resource.Quantity) (resource.Quantity, bool, error) {
	if !r.enter() {
		// Not final: the next instance resizes it.
		return size, false, status.Errorf(codes.Unavailable, "dirpv is shutting down; volume %s is resized by the next instance", pv.Name)
	}
	defer r.inflight.Done()
	logger := klog.FromContext(r.ctx).WithValues("pv", pv.Name, "size", size.String())
	if err := r.resizableHere(pv); err != nil {
		return size, false, status.Error(codes.FailedPrecondition, err.Error())
	}
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	if err != nil {
		return size, false, status.Errorf(codes.InvalidArgument, "PV %s: %v", pv.Name, err)
	}
	if size.Sign() <= 0 {
		return size, false, status.Errorf(codes.InvalidArgument, "PV %s: size %s is not positive", pv.Name, size.String())
	}
	if attrs.Backend == volume.BackendNFS {
		logger.Info("Recorded the new size of an NFS volume; NFS sizes are not enforced", "path", attrs.Path)
		return size, false, nil
	}
	var claim volume.Claim
	if ref := pv.Spec.ClaimRef; ref != nil {
		claim = volume.Claim{UID: string(ref.UID), PVName: pv.Name}
	}
	ctx, cancel := context.WithTimeout(r.ctx, r.p.cfg.OperationTimeout)
	defer cancel()
	var limited bool
	unlock, err := r.p.lockVolume(ctx, attrs)
	if err != nil {
		return size, false, status.Errorf(codes.Aborted, "node %s: resize volume %s: %v", r.p.cfg.NodeName, pv.Name, err)
	}
	err = r.p.onStore(ctx, attrs, nil, func(root *volume.Root) error {
		limited, err = root.Resize(attrs.Path, claim, uint64(size.Value()))
		return err
	})
	unlock()
	switch {
	case errors.Is(err, volume.ErrNotEnoughSpace):
		return size, false, status.Errorf(codes.OutOfRange, "node %s cannot grow volume %s to %s: %v", r.p.cfg.NodeName, pv.Name, size.String(), err)
	case isNotExist(err):
		return size, false, status.Errorf(codes.NotFound, "node %s: directory of volume %s: %v", r.p.cfg.NodeName, pv.Name, err)
	case errors.Is(err, volume.ErrNotClaimsVolume), errors.Is(err, volume.ErrNotDirectory), errors.Is(err, volume.ErrBaseNotAllowed):
		return size, false, status.Errorf(codes.FailedPrecondition, "node %s refuses to resize volume %s: %v", r.p.cfg.NodeName, pv.Name, err)
	case err != nil:
		return size, false, fmt.Errorf("node %s: resize volume %s to %s: %w", r.p.cfg.NodeName, pv.Name, size.String(), err)
	}
	if limited {
		logger.Info("Raised the volume's size limit", "path", attrs.Path)
	} else {
		logger.Info("Recorded the new size of a volume whose size is not enforced", "path", attrs.Path)
	}
	return size, false, nil
}
