package provisioner

import (
	"context"
	"errors"
	"fmt"
	"path"
	"slices"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
	"github.com/dirpv/dirpv/volume/quota"
)

// Provision creates the claim's directory and returns its PV. Every check runs before anything
// is created, so a refused claim leaves nothing on disk.
func (p *Provisioner) Provision(ctx context.Context, opts controller.ProvisionOptions) (*v1.PersistentVolume, controller.ProvisioningState, error) {
	logger := klog.FromContext(ctx).WithValues("claim", klog.KObj(opts.PVC), "pv", opts.PVName)
	ctx = klog.NewContext(ctx, logger)
	// Refusals of the class or the claim are permanent until the user changes one of them.
	params, err := p.checkClaim(opts)
	if err != nil {
		return nil, controller.ProvisioningFinished, invalid(err)
	}
	claim := opts.PVC
	rel, err := params.pattern.expand(pathVars{
		namespace:   claim.Namespace,
		pvcName:     claim.Name,
		pvName:      opts.PVName,
		labels:      claim.Labels,
		annotations: claim.Annotations,
	})
	if err != nil {
		return nil, controller.ProvisioningFinished, invalid(err)
	}
	attrs := volume.Attributes{Backend: params.backend, Server: params.server, Share: params.share, BasePath: params.basePath, Path: rel,
		BaseMountPoint: params.mountPoint}

	var hostname string
	if params.backend == volume.BackendLocal {
		if hostname, err = p.nodeHostname(ctx); err != nil {
			return nil, controller.ProvisioningNoChange, err
		}
	}
	// Looked up first: a failed resolution must not leave a copy running for the lib to forget.
	copying := p.copies.running(claim.UID)
	src, state, err := p.resolveDataSource(ctx, claim, attrs)
	if err != nil {
		if copying && (state != controller.ProvisioningFinished || isInvalid(err)) {
			// The claim goes elsewhere or waits for its user: no call takes this copy's volume.
			logger.Info("Abandoning the copy under way", "reason", err.Error())
			p.copies.abandon(claim.UID)
		}
		return nil, state, err
	}
	owner := volume.Claim{UID: string(claim.UID), PVName: opts.PVName}
	size := claim.Spec.Resources.Requests[v1.ResourceStorage]
	mk := func(ctx context.Context) (made, error) {
		return p.makeVolume(ctx, attrs, opts.StorageClass.MountOptions, params, owner, size, src)
	}
	discard := func(m made) {
		p.discardVolume(logger, attrs, opts.StorageClass.MountOptions, owner, m)
	}
	var m made
	if src == nil {
		m, err = mk(ctx)
	} else if m, state, err = p.copyVolume(ctx, claim, src, mk, discard); state != controller.ProvisioningFinished {
		return nil, state, err
	}
	attrs.Quota = m.quota
	var exists *volume.ExistsError
	switch {
	case errors.Is(err, volume.ErrBaseChanged):
		// Not rescheduled: the claim waits for the disk, which the admin is told to bring back,
		// rather than go to a node the scheduler chose from this node's stale capacity.
		err = fmt.Errorf("node %s: %w", p.cfg.NodeName, err)
		p.baseChanged(claim, err)
		return nil, controller.ProvisioningFinished, err
	case errors.As(err, &exists):
		// Handing over a directory that another claim's data may be in, or one dirpv did not
		// make, could expose that data. No retry fixes it until someone changes the pattern
		// or removes the directory.
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf(
			"directory %s already exists in %s and %s; refusing to reuse it for a new volume "+
				"(include ${pv.metadata.name} in %s, or remove the directory)",
			rel, storeName(attrs), exists.Reason(), ParamPathPattern))
	case errors.Is(err, volume.ErrReservedName):
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf("directory %s: %w", rel, err))
	case errors.Is(err, unix.EPERM) && attrs.Backend == volume.BackendNFS && src != nil:
		// A copy takes its source's owner, not the class's.
		return nil, controller.ProvisioningFinished, fmt.Errorf("create directory %s: %w: the NFS server refused to give the copy "+
			"the owner of %s; it may squash root (root_squash): export %s with no_root_squash",
			rel, err, src.what, volume.ExportSource(attrs.Server, attrs.Share))
	case errors.Is(err, unix.EPERM) && attrs.Backend == volume.BackendNFS:
		return nil, controller.ProvisioningFinished, fmt.Errorf("create directory %s: %w: the NFS server refused to give the directory to %d:%d; "+
			"it may squash root (root_squash): export %s with no_root_squash, or drop %s and %s from the StorageClass",
			rel, err, params.owner.UID, params.owner.GID, volume.ExportSource(attrs.Server, attrs.Share), ParamUID, ParamGID)
	case errors.Is(err, export.ErrUnresponsive):
		// An NFS server that did not answer may still create the directory; retrying adopts it.
		return nil, controller.ProvisioningInBackground, fmt.Errorf("create directory %s: %w", rel, err)
	case errors.Is(err, volume.ErrNoRoomForCopy):
		// Nothing was copied. The lib retries with its back-off, each retry checking again:
		// the copy starts once space is freed, and never fills the base meanwhile.
		err = fmt.Errorf("%w, in %s", err, storeName(attrs))
		if p.cfg.Events != nil {
			p.cfg.Events.Event(claim, v1.EventTypeWarning, ReasonNoRoomForCopy, err.Error()+"; trying again with back-off")
		}
		return nil, controller.ProvisioningFinished, err
	case src != nil && (errors.Is(err, unix.EDQUOT) || errors.Is(err, unix.ENOSPC)):
		// The source holds more than its capacity says (written past a limit that was not
		// enforced, say): every retry would fail the same way, each after a full copy.
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf(
			"%s does not fit in the %s this claim asks for: it holds at least %s (copied when the volume ran out of room: %w); "+
				"request more than the source holds", src.what, size.String(),
			resource.NewQuantity(m.stats.Bytes, resource.BinarySI).String(), err))
	case src != nil && (errors.Is(err, volume.ErrInsideVolume) || errors.Is(err, volume.ErrNotDirectory)):
		// As for an empty volume below, but a copy never goes back to the scheduler.
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf("create directory %s in %s: %w", rel, storeName(attrs), err))
	case src != nil && err != nil:
		// Another node cannot copy a local tree: the claim stays where its source is.
		return nil, controller.ProvisioningFinished, fmt.Errorf("create directory %s in %s: %w", rel, storeName(attrs), err)
	case errors.Is(err, quota.ErrNotEnforceable):
		// Another node's base may well enforce sizes.
		return nil, controller.ProvisioningReschedule, fmt.Errorf(
			"the class asks for sizes to be enforced (%s: %s) but base path %s on node %s cannot: %w",
			ParamCapacityEnforcement, EnforceRequired, attrs.BasePath, p.cfg.NodeName, err)
	case attrs.Backend == volume.BackendLocal && isNodeLocalFailure(err):
		// Another node may well have room: hand the claim back to the scheduler (the lib
		// removes the selected-node annotation) rather than keep the pod stuck here.
		return nil, controller.ProvisioningReschedule, fmt.Errorf(
			"node %s cannot hold the volume: create directory %s in base path %s: %w; asking the scheduler to choose another node",
			p.cfg.NodeName, rel, attrs.BasePath, err)
	case errors.Is(err, volume.ErrInsideVolume), errors.Is(err, volume.ErrNotDirectory):
		// The path runs through another volume, or through a symlink or file: no retry helps
		// until someone changes the pattern or removes what is in the way. A base path this
		// node cannot use (a symlink in it, say) went back to the scheduler above instead.
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf("create directory %s in %s: %w", rel, storeName(attrs), err))
	case err != nil && attrs.Backend == volume.BackendNFS:
		// The error names the controller's own mount point; the user needs the server.
		return nil, controller.ProvisioningFinished, fmt.Errorf("create directory %s in %s: %w", rel, storeName(attrs), err)
	case err != nil:
		return nil, controller.ProvisioningFinished, fmt.Errorf("create directory %s: %w", rel, err)
	}
	if notEnforced, created := m.notEnforced, m.created; notEnforced != nil && created {
		logger.Info("Volume size is not enforced", "path", rel, "reason", notEnforced.Error())
		if p.cfg.Events != nil {
			p.cfg.Events.Eventf(claim, v1.EventTypeNormal, "SizeNotEnforced",
				"the volume's size %s is not enforced on node %s (%s: %s): %v",
				size.String(), p.cfg.NodeName, ParamCapacityEnforcement, EnforceBestEffort, notEnforced)
		}
	}
	if m.created {
		logger.Info("Provisioned volume", "path", rel, "backend", attrs.Backend, "quota", attrs.Quota)
	} else {
		// A retry after the PV of an earlier attempt was never saved (a crash, a lost leader).
		logger.Info("adopted existing directory", "path", rel, "backend", attrs.Backend)
	}
	return p.buildPV(opts, params, attrs, hostname), controller.ProvisioningFinished, nil
}

// made is what makeVolume did.
type made struct {
	created bool
	// quota is the volume's limit ID, "" if it has none.
	quota string
	// notEnforced says why a best-effort local volume got no limit.
	notEnforced error
	stats       volume.CopyStats
}

// makeVolume creates the volume's directory with its size limit, if its class has one, and
// with src's contents if src is not nil.
func (p *Provisioner) makeVolume(ctx context.Context, attrs volume.Attributes, mountOptions []string, params *classParams,
	owner volume.Claim, size resource.Quantity, src *sourceTree,
) (made, error) {
	var m made
	rel := attrs.Path
	fn := func(ctx context.Context, root, from *volume.Root) error {
		var limit uint64
		if attrs.Backend == volume.BackendLocal && size.Sign() > 0 {
			if err := checkRoom(root, rel, size); err != nil {
				return err
			}
			fs, err := root.Quota()
			if err != nil {
				return err
			}
			if why := fs.Enforces(); why == nil {
				limit = uint64(size.Value())
			} else if params.capacity == EnforceRequired {
				return why
			} else {
				m.notEnforced = why
			}
		}
		var id quota.ID
		var err error
		switch {
		case from != nil:
			if err := checkSourceOwner(from, src); err != nil {
				return err
			}
			if _, err := root.Stat(rel); isNotExist(err) {
				// A retry adopting an earlier attempt's copy needs no room.
				if err := root.CheckRoomForCopy(ctx, src.in(from), p.cfg.CopySpaceMargin); err != nil {
					return err
				}
			}
			m.created, id, m.stats, err = root.MkdirAllFrom(ctx, rel, owner, limit, src.in(from))
		case limit > 0:
			m.created, id, err = root.MkdirAllLimited(rel, params.owner, owner, limit)
		default:
			m.created, err = root.MkdirAll(rel, params.owner, owner)
		}
		m.quota = id.String()
		if err == nil && limit > 0 && m.quota == "" && params.capacity == EnforceRequired {
			// Adopted from an attempt made while the base could not enforce.
			return fmt.Errorf("volume %s was made without a size limit: %w", rel, quota.ErrNotEnforceable)
		}
		return err
	}
	unlock, err := p.lockVolume(ctx, attrs)
	if err != nil {
		return m, err
	}
	defer unlock()
	if src == nil {
		err = p.onStore(ctx, attrs, mountOptions, func(root *volume.Root) error { return fn(ctx, root, nil) })
	} else {
		err = p.onStores(ctx, attrs, mountOptions, src, fn)
	}
	if err == nil && attrs.Backend == volume.BackendLocal {
		// Before the PV exists: a base that holds a volume must keep its identity.
		err = p.locals.Held(attrs.BasePath)
	}
	return m, err
}

// ReasonNoRoomForCopy is the event reason on a claim whose copy (a clone, a restore), or on
// the source claim of a snapshot whose copy, was not started: its base has not the free space
// for it (volume.ErrNoRoomForCopy).
const ReasonNoRoomForCopy = "NotEnoughSpaceForCopy"

// ReasonBaseFileSystemChanged is the event reason on a claim or PV whose local base is not
// the file system it was (volume.ErrBaseChanged).
const ReasonBaseFileSystemChanged = "BaseFileSystemChanged"

// baseChanged tells the claim or PV that its base is refused, and why.
func (p *Provisioner) baseChanged(obj runtime.Object, err error) {
	reason := ReasonBaseFileSystemChanged
	if isNotMounted(err) {
		reason = ReasonBasePathNotMounted
	}
	if p.cfg.Events != nil {
		p.cfg.Events.Event(obj, v1.EventTypeWarning, reason, err.Error())
	}
}

// checkRoom refuses a new local volume larger than the base's free space. A limit does not
// reserve space, and the scheduler chose this node from a published figure that may be a
// poll old: the volume would fill the disk before it reached its size. An existing directory
// (a retry adopting an earlier attempt's) is not checked: its claim was already given room.
func checkRoom(root *volume.Root, rel string, size resource.Quantity) error {
	avail, err := root.Available()
	if err != nil || uint64(size.Value()) <= avail {
		return err
	}
	if _, err := root.Stat(rel); !isNotExist(err) {
		return nil
	}
	return fmt.Errorf("the claim asks for %s but only %s is free: %w",
		size.String(), resource.NewQuantity(int64(avail), resource.BinarySI).String(), unix.ENOSPC)
}

// checkClaim parses the class and refuses claims this instance cannot serve.
func (p *Provisioner) checkClaim(opts controller.ProvisionOptions) (*classParams, error) {
	params, err := checkClassAndClaim(opts.StorageClass, opts.PVC)
	if err != nil {
		return nil, err
	}
	switch params.backend {
	case volume.BackendLocal:
		if p.cfg.Role != RoleNode {
			return nil, fmt.Errorf("claim has no selected node: local volumes are created by the dirpv node plugin on the scheduled node")
		}
		if opts.SelectedNodeName != p.cfg.NodeName {
			return nil, fmt.Errorf("claim was placed on node %q, this is %q", opts.SelectedNodeName, p.cfg.NodeName)
		}
	case volume.BackendNFS:
		if p.cfg.Role != RoleController {
			return nil, fmt.Errorf("NFS volumes are created by dirpv controller, not on a node")
		}
	}
	return params, nil
}

// checkClassAndClaim parses the class and refuses a claim that no instance of dirpv could
// serve, wherever it was placed.
func checkClassAndClaim(class *storagev1.StorageClass, claim *v1.PersistentVolumeClaim) (*classParams, error) {
	params, err := parseParameters(class.Parameters)
	if err != nil {
		return nil, err
	}
	if claim.Spec.VolumeMode != nil && *claim.Spec.VolumeMode == v1.PersistentVolumeBlock {
		return nil, fmt.Errorf("volumeMode Block is not supported: dirpv volumes are directories (use Filesystem)")
	}
	if err := checkDataSource(claim); err != nil {
		return nil, err
	}
	if params.backend == volume.BackendLocal {
		if class.VolumeBindingMode == nil || *class.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
			return nil, fmt.Errorf("StorageClass %s has backend local but volumeBindingMode Immediate: "+
				"a local volume must be created on the node where its pod runs, so set volumeBindingMode: WaitForFirstConsumer", class.Name)
		}
		for _, m := range claim.Spec.AccessModes {
			if m != v1.ReadWriteOnce && m != v1.ReadWriteOncePod {
				return nil, fmt.Errorf("access mode %s is not supported by backend local, whose volumes live on one node: use ReadWriteOnce or ReadWriteOncePod, or an nfs class", m)
			}
		}
		if len(class.MountOptions) > 0 {
			return nil, fmt.Errorf("mountOptions %s are not supported by backend local (bind mounts)", volume.QuoteList(class.MountOptions))
		}
	}
	if len(claim.Spec.AccessModes) == 0 {
		return nil, fmt.Errorf("claim has no access modes")
	}
	if _, ok := claim.Spec.Resources.Requests[v1.ResourceStorage]; !ok {
		return nil, fmt.Errorf("claim requests no storage size")
	}
	return params, nil
}

// onStore runs fn on the root of the volume's share or base path.
func (p *Provisioner) onStore(ctx context.Context, attrs volume.Attributes, mountOptions []string, fn func(*volume.Root) error) error {
	switch attrs.Backend {
	case volume.BackendNFS:
		if p.exports == nil {
			return fmt.Errorf("NFS volumes are handled by dirpv controller, not on a node")
		}
		return p.exports.Do(ctx, attrs.Server, attrs.Share, mountOptions, fn)
	case volume.BackendLocal:
		if p.cfg.AllowedBases == nil {
			return fmt.Errorf("local volumes are handled by dirpv node, not by the controller")
		}
		// Delete goes through here too: a PV, which anyone allowed to create PVs can write,
		// must not make the node remove directories outside its bases either.
		base, _, err := p.cfg.AllowedBases.Locate(attrs.BasePath, attrs.Path)
		if err != nil {
			return err
		}
		if attrs.BaseMountPoint {
			return doMounted(&p.locals, base, attrs.BasePath, fn)
		}
		return p.locals.Do(base, attrs.BasePath, fn)
	}
	return fmt.Errorf("unknown backend %q", attrs.Backend)
}

// lockVolume waits until no other creation, resize or deletion of the volume at attrs' path
// runs in this process, and returns the function that lets the next one go. A Delete that
// found no directory there must not then remove the one a new claim of a pattern without
// ${pv.metadata.name} made at the same path meanwhile, and a Resize must not raise the limit
// of a quota ID that a Delete has just released: an empty ID with a limit is never handed out
// again.
func (p *Provisioner) lockVolume(ctx context.Context, attrs volume.Attributes) (func(), error) {
	return p.volumeLocks.Lock(ctx, storeName(attrs)+"\x00"+path.Clean("/"+attrs.Path))
}

func storeName(a volume.Attributes) string {
	if a.Backend == volume.BackendNFS {
		return "NFS export " + volume.ExportSource(a.Server, a.Share)
	}
	return "base path " + a.BasePath
}

// nodeHostname returns the node's kubernetes.io/hostname label, which PV node affinity must
// match; it may differ from the node name on some clouds.
//
// Callers that find no cached answer each make their own GET, bounded by apiTimeout: a
// few redundant GETs at startup cost less than every worker waiting behind one that hangs
// (an API server that stopped answering), and a worker's own context may have no deadline.
func (p *Provisioner) nodeHostname(ctx context.Context) (string, error) {
	p.hostnameMu.Lock()
	hostname := p.hostname
	p.hostnameMu.Unlock()
	if hostname != "" {
		return hostname, nil
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	node, err := p.cfg.Client.CoreV1().Nodes().Get(ctx, p.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("read node %s for its %s label: %w", p.cfg.NodeName, v1.LabelHostname, err)
	}
	hostname = node.Labels[v1.LabelHostname]
	if hostname == "" {
		hostname = node.Name
	}
	p.hostnameMu.Lock()
	p.hostname = hostname
	p.hostnameMu.Unlock()
	return hostname, nil
}

func (p *Provisioner) buildPV(opts controller.ProvisionOptions, params *classParams, attrs volume.Attributes, hostname string) *v1.PersistentVolume {
	class, claim := opts.StorageClass, opts.PVC
	reclaim := v1.PersistentVolumeReclaimDelete
	if class.ReclaimPolicy != nil {
		reclaim = *class.ReclaimPolicy
	}
	fs := v1.PersistentVolumeFilesystem
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        opts.PVName,
			Annotations: map[string]string{AnnOnDelete: string(params.onDelete)},
		},
		Spec: v1.PersistentVolumeSpec{
			PersistentVolumeReclaimPolicy: reclaim,
			AccessModes:                   slices.Clone(claim.Spec.AccessModes),
			VolumeMode:                    &fs,
			MountOptions:                  slices.Clone(class.MountOptions),
			Capacity:                      v1.ResourceList{v1.ResourceStorage: claim.Spec.Resources.Requests[v1.ResourceStorage]},
			PersistentVolumeSource: v1.PersistentVolumeSource{
				CSI: &v1.CSIPersistentVolumeSource{
					Driver:           p.cfg.DriverName,
					VolumeHandle:     volume.Handle(attrs.Backend, opts.PVName),
					VolumeAttributes: attrs.Map(),
				},
			},
		},
	}
	if attrs.Backend == volume.BackendLocal {
		pv.Annotations[AnnNode] = p.cfg.NodeName
		if attrs.BaseMountPoint {
			pv.Annotations[AnnBasePathMountPoint] = string(MountPointRequired)
		}
		pv.Labels = map[string]string{LabelNode: NodeLabel(p.cfg.NodeName)}
		pv.Spec.NodeAffinity = &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{
			NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{{
				Key: v1.LabelHostname, Operator: v1.NodeSelectorOpIn, Values: []string{hostname},
			}}}},
		}}
	}
	return pv
}
