package provisioner

import (
	"context"
	"errors"
	"maps"
	"math/bits"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
)

// PublishesCapacity says whether this instance publishes CSIStorageCapacity for the class:
// the scheduler looks at capacity only for WaitForFirstConsumer classes, and each instance
// speaks for the backend it provisions (its node's bases, or the controller's exports). The
// class is not parsed here: a broken class of this backend gets GetCapacity's error, logged
// and retried, instead of a figure.
func (p *Provisioner) PublishesCapacity(class *storagev1.StorageClass) bool {
	if class.Provisioner != p.cfg.DriverName || class.VolumeBindingMode == nil ||
		*class.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		return false
	}
	local := class.Parameters[ParamBackend] == string(volume.BackendLocal)
	return local == (p.cfg.Role == RoleNode)
}

// CapacityTopology returns the node labels that CSIStorageCapacity objects of this instance
// select. A node instance's is its node's kubernetes.io/hostname label, the one key its PVs'
// node affinity uses (buildPV): every node has it, so the scheduler matches the objects to the
// node without dirpv reporting a topology in NodeGetInfo (which would then have to appear in
// every PV's affinity, old ones included). The controller's exports are reached from every
// node: nil, which selects all of them.
func (p *Provisioner) CapacityTopology(ctx context.Context) (map[string]string, error) {
	if p.cfg.Role != RoleNode {
		return nil, nil
	}
	hostname, err := p.nodeHostname(ctx)
	if err != nil {
		return nil, err
	}
	return map[string]string{v1.LabelHostname: hostname}, nil
}

// capacityProbe is a directory name beneath a base, for checks that take a volume's path
// when only the base matters.
const capacityProbe = "x"

// GetCapacity serves the capacity controller in-process, as a CSI controller's GetCapacity
// would over gRPC: the free space of the class's base path on this node (role node) or of its
// export (role controller), from the same parser and the same base checks as Provision. A
// class this instance cannot parse or does not serve is InvalidArgument.
func (p *Provisioner) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest, _ ...grpc.CallOption) (*csi.GetCapacityResponse, error) {
	params, err := parseParameters(req.GetParameters())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	attrs := volume.Attributes{Backend: params.backend, Server: params.server, Share: params.share, BasePath: params.basePath, Path: capacityProbe,
		BaseMountPoint: params.mountPoint}
	var mountOptions []string
	switch {
	case params.backend == volume.BackendLocal && p.cfg.Role == RoleNode:
	case params.backend == volume.BackendNFS && p.cfg.Role == RoleController:
		mountOptions = p.exportMountOptions(req.GetParameters())
	default:
		return nil, status.Errorf(codes.InvalidArgument, "backend %s is not served by dirpv %s", params.backend, p.cfg.Role)
	}
	var avail uint64
	err = p.onStore(ctx, attrs, mountOptions, func(root *volume.Root) error {
		if params.backend == volume.BackendLocal && params.capacity == EnforceRequired {
			// Room the class cannot use: Provision refuses such a node and reschedules, so
			// it must not draw the scheduler there.
			fs, err := root.Quota()
			if err != nil {
				return err
			}
			if fs.Enforces() != nil {
				return nil
			}
		}
		var err error
		avail, err = root.Available()
		return err
	})
	switch {
	case errors.Is(err, volume.ErrBaseChanged):
		// Its volumes are refused there (not the file system it was, or not mounted): no room
		// to draw the scheduler with.
		klog.FromContext(ctx).Info("Publishing no capacity for a base that is refused", "err", err.Error())
		return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
	case errors.Is(err, volume.ErrBaseNotAllowed):
		return nil, status.Error(codes.PermissionDenied, err.Error())
	case errors.Is(err, export.ErrUnresponsive):
		return nil, status.Errorf(codes.Unavailable, "free space of %s: %v", storeName(attrs), err)
	case err != nil:
		return nil, status.Errorf(codes.FailedPrecondition, "free space of %s: %v", storeName(attrs), err)
	}
	return &csi.GetCapacityResponse{AvailableCapacity: int64(roundCapacity(avail))}, nil
}

// exportMountOptions returns the mount options of a class with these parameters, so that
// capacity is read through the mount that provisioning uses rather than a second mount of
// the export (a GetCapacityRequest carries no mount options). Classes with equal parameters
// name the same export, whose free space is the same through any of its mounts.
func (p *Provisioner) exportMountOptions(params map[string]string) []string {
	classes, err := p.cfg.Classes.List(labels.Everything())
	if err != nil {
		return nil
	}
	// The same class every time, whichever order the lister returns them in.
	slices.SortFunc(classes, func(a, b *storagev1.StorageClass) int { return strings.Compare(a.Name, b.Name) })
	for _, c := range classes {
		if c.Provisioner == p.cfg.DriverName && maps.Equal(c.Parameters, params) {
			return c.MountOptions
		}
	}
	return nil
}

// capacityStep is the smallest granularity of a published figure.
const capacityStep = 1 << 20

// roundCapacity rounds free bytes down to a step of at least 1 MiB and at most 1/64 of the
// figure (a power of two). Exact bytes would change with every file written on the base and
// rewrite each CSIStorageCapacity object at every poll; with this step an object changes
// only when free space moves by more than ~1.6%, while the scheduler never sees more room
// than there is.
func roundCapacity(avail uint64) uint64 {
	step := uint64(capacityStep)
	if avail >= 64*capacityStep {
		step = uint64(1) << (bits.Len64(avail) - 1 - 6)
	}
	return avail / step * step
}
