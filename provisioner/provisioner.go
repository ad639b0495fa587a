// Package provisioner is dirpv's sig-storage-lib-external-provisioner Provisioner: it turns a
// claim into a directory on an NFS export or under a node-local base path, and back.
//
// One Provisioner runs in `dirpv controller` (role controller, leader-elected) for NFS classes
// and in every `dirpv node` (role node, no leader election) for local classes, where it accepts
// only the claims the scheduler placed on its own node.
package provisioner

import (
	"context"
	"errors"
	"fmt"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/internal/keyed"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota"
)

// Annotations dirpv puts on the PVs it makes, so Delete never needs the StorageClass.
const (
	// AnnOnDelete holds the class's onDelete policy.
	AnnOnDelete = "dirpv.io/on-delete"
	// AnnNode names the node holding a local volume.
	AnnNode = "dirpv.io/node"
)

// annSelectedNode is set on a claim by the scheduler for WaitForFirstConsumer classes.
const annSelectedNode = "volume.kubernetes.io/selected-node"

// Role says which claims a Provisioner serves.
type Role string

const (
	// RoleController serves NFS classes, and reports misconfigured local classes.
	RoleController Role = "controller"
	// RoleNode serves local classes for claims placed on its own node.
	RoleNode Role = "node"
)

// Config configures a Provisioner.
type Config struct {
	// DriverName is the CSI driver name written into PVs; also the provisioner name.
	DriverName string
	Role       Role
	// NodeName is this node's name (role node).
	NodeName string
	// AllowedBases are where local volumes may live (role node, required): the same list the
	// node plugin mounts from, so that a class naming another basePath is refused with an
	// event instead of getting directories that can never be mounted.
	AllowedBases *volume.AllowedBases
	// StateDir is the node's own directory for what dirpv must remember across restarts
	// (role node, required): the identity of each local base (volume.BaseRecords), under
	// bases/. It must not be on any base.
	StateDir string
	Client   kubernetes.Interface
	// Classes lists StorageClasses; the Qualifier needs a class's backend.
	Classes storagelisters.StorageClassLister
	// Mounter mounts NFS exports (role controller).
	Mounter mount.Interface
	// WorkDir holds the controller's NFS mounts.
	WorkDir string
	// OperationTimeout bounds each call that touches NFS, mounting included.
	OperationTimeout time.Duration
	// IdleUnmount is how long an unused NFS mount stays mounted.
	IdleUnmount time.Duration
	// CloneTimeout bounds each copy that starts a volume from a data source, and each
	// snapshot's copy; 0 means DefaultCloneTimeout. The copy runs in the background meanwhile.
	CloneTimeout time.Duration
	// Snapshots reads VolumeSnapshots and their contents, to restore claims from them; nil
	// refuses such claims.
	Snapshots snapclientset.Interface
	// Events records events beyond those the lib records: on PVs of volumes left on lost
	// nodes (role controller), on claims whose size is not enforced (role node). Nil records
	// none.
	Events record.EventRecorder
	// Volumes lists PVs (role node): the node's quota checks look for its own volumes there.
	Volumes corelisters.PersistentVolumeLister
	// QuotaCheckPeriod is how often the node checks its limited local volumes for data
	// outside their limits, repairs what it can and tells their claims (role node, with
	// Volumes); 0 disables the checks.
	QuotaCheckPeriod time.Duration
}

// Provisioner implements controller.Provisioner, Qualifier and DeletionGuard.
type Provisioner struct {
	cfg     Config
	exports *exports
	locals  localRoots
	// nodePlugins rate-limits the controller's checks for a missing node plugin.
	nodePlugins nodePluginChecks
	// unplaced rate-limits the controller's checks of local claims no node can serve.
	unplaced claimChecks
	// copies are the copies under way that start volumes from data sources.
	copies *copyJobs
	// volumeLocks serialise the creation, resize and deletion of each volume (lockVolume).
	volumeLocks keyed.Locks[string]
	// escapes are the node's quota checks' findings (runQuotaChecks).
	escapes escapeChecks

	// hostname caches nodeHostname's answer once it has one. Only the read and the store are
	// under the lock, never the API call: a GET that hangs must not hold up the other workers.
	hostnameMu sync.Mutex
	hostname   string
}

var (
	_ controller.Provisioner   = (*Provisioner)(nil)
	_ controller.Qualifier     = (*Provisioner)(nil)
	_ controller.DeletionGuard = (*Provisioner)(nil)
)

// New checks cfg and returns a Provisioner. Call Run to start its housekeeping.
func New(cfg Config) (*Provisioner, error) {
	switch cfg.Role {
	case RoleController:
		if cfg.WorkDir == "" || cfg.Mounter == nil {
			return nil, fmt.Errorf("role controller needs a work dir and a mounter")
		}
	case RoleNode:
		if cfg.NodeName == "" || cfg.AllowedBases == nil || cfg.StateDir == "" {
			return nil, fmt.Errorf("role node needs the node name, the allowed base paths and a state dir")
		}
	default:
		return nil, fmt.Errorf("unknown role %q", cfg.Role)
	}
	if cfg.DriverName == "" || cfg.Client == nil || cfg.Classes == nil {
		return nil, fmt.Errorf("driver name, client and class lister are required")
	}
	if cfg.OperationTimeout <= 0 {
		cfg.OperationTimeout = 30 * time.Second
	}
	if cfg.IdleUnmount <= 0 {
		cfg.IdleUnmount = 5 * time.Minute
	}
	if cfg.CloneTimeout <= 0 {
		cfg.CloneTimeout = DefaultCloneTimeout
	}
	p := &Provisioner{cfg: cfg, copies: newCopyJobs()}
	if cfg.Role == RoleController {
		p.exports = newExports(cfg.Mounter, cfg.WorkDir, cfg.OperationTimeout)
	} else {
		p.locals.records = volume.NewBaseRecords(filepath.Join(cfg.StateDir, "bases"))
	}
	return p, nil
}

// DefaultCloneTimeout is the default of Config.CloneTimeout.
const DefaultCloneTimeout = 6 * time.Hour

// Run unmounts idle NFS exports (role controller) or checks local volumes for quota escapes
// (role node) until ctx is done, then stops the copies under way and releases every mount and
// directory.
func (p *Provisioner) Run(ctx context.Context) {
	defer p.locals.closeAll()
	if p.exports != nil {
		defer p.exports.closeAll(context.WithoutCancel(ctx))
	}
	// Before the bases and mounts go: a copy must not outlive the roots it works on.
	defer func() {
		if !p.copies.stop(p.cfg.OperationTimeout) {
			klog.FromContext(ctx).Info("Shutting down with copies still running: their next step waits on storage")
		}
	}()
	if p.exports == nil {
		if p.cfg.QuotaCheckPeriod > 0 && p.cfg.Volumes != nil {
			p.runQuotaChecks(ctx)
		}
		<-ctx.Done()
		return
	}
	tick := time.NewTicker(p.cfg.IdleUnmount / 2)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			p.exports.sweep(ctx, p.cfg.IdleUnmount)
		}
	}
}

// PendingDeletes counts the NFS volumes that Delete moved to the trash and whose trees are
// still being removed in the background.
func (p *Provisioner) PendingDeletes() int {
	if p.exports == nil {
		return 0
	}
	return p.exports.pendingDeletes()
}

// ShouldProvision says whether this instance serves the claim. Claims of other provisioners'
// classes are never served nor reported on: the lib asks before it checks the provisioner.
// Claims of local classes go to the node the scheduler selected; everything else, broken local
// classes included, goes to the controller, so that exactly one instance reports a bad class
// on the claim. The controller also reports local claims placed on a node where no dirpv node
// plugin runs.
func (p *Provisioner) ShouldProvision(ctx context.Context, claim *v1.PersistentVolumeClaim) bool {
	if claim.DeletionTimestamp != nil {
		// Its volume would only be released at once. The lib would call Provision for it
		// until it is gone (pvc-protection holds it while a pod names it), and for a clone
		// start its copy again each time ClaimDeleted cancelled it.
		return false
	}
	className := ptrValue(claim.Spec.StorageClassName)
	class, err := p.cfg.Classes.Get(className)
	if err != nil {
		if p.cfg.Role == RoleController {
			// The lib reports a missing class on a claim handed to dirpv; let the controller
			// be the one to do so.
			return true
		}
		// The claim's watch can deliver it before the class's watch delivers the class it
		// names. Answering no here would leave a claim placed on this node to the lib's
		// resync (15 min); answering yes for one kube-controller-manager handed to dirpv lets
		// the lib fail on the missing class and retry with back-off until the cache has it.
		return claim.Annotations[annSelectedNode] == p.cfg.NodeName &&
			claim.Annotations[annStorageProvisioner] == p.cfg.DriverName
	}
	if class.Provisioner != p.cfg.DriverName {
		return false
	}
	local := class.Parameters[ParamBackend] == string(volume.BackendLocal)
	lateBinding := class.VolumeBindingMode != nil && *class.VolumeBindingMode == storagev1.VolumeBindingWaitForFirstConsumer
	node := claim.Annotations[annSelectedNode]
	if p.cfg.Role == RoleNode {
		return local && lateBinding && node == p.cfg.NodeName
	}
	switch {
	case local && lateBinding && node != "":
		p.checkNodePlugin(ctx, claim, class, node)
	case lateBinding && node == "":
		p.checkUnplaced(ctx, claim, class)
	}
	return !local || !lateBinding
}

// ShouldDelete says whether this instance deletes the PV's directory: NFS volumes in the
// controller, local volumes on their own node, and in the controller also local volumes whose
// node is gone, so that their claims' deletion completes instead of waiting forever.
func (p *Provisioner) ShouldDelete(ctx context.Context, pv *v1.PersistentVolume) bool {
	return p.responsibleFor(ctx, pv) == ""
}

// responsibleFor returns why this instance does not handle the PV, or "" if it does.
func (p *Provisioner) responsibleFor(ctx context.Context, pv *v1.PersistentVolume) string {
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != p.cfg.DriverName {
		return fmt.Sprintf("PV %s is not a %s volume", pv.Name, p.cfg.DriverName)
	}
	backend := volume.Backend(pv.Spec.CSI.VolumeAttributes[volume.AttrBackend])
	switch {
	case p.cfg.Role == RoleController && backend == volume.BackendLocal:
		if p.nodeLost(ctx, pv) {
			return ""
		}
		return fmt.Sprintf("PV %s is a local volume, deleted on its node", pv.Name)
	case p.cfg.Role == RoleNode && backend != volume.BackendLocal:
		return fmt.Sprintf("PV %s is not a local volume, deleted by the controller", pv.Name)
	case p.cfg.Role == RoleNode && pv.Annotations[AnnNode] != p.cfg.NodeName:
		return fmt.Sprintf("PV %s lives on node %q, not on %q", pv.Name, pv.Annotations[AnnNode], p.cfg.NodeName)
	}
	return ""
}

// nodeLost reports whether a released local PV's node no longer exists. Only released PVs
// due for deletion are looked up, since the lib asks about every PV it sees.
func (p *Provisioner) nodeLost(ctx context.Context, pv *v1.PersistentVolume) bool {
	node := pv.Annotations[AnnNode]
	if node == "" || pv.Status.Phase != v1.VolumeReleased || pv.Spec.PersistentVolumeReclaimPolicy != v1.PersistentVolumeReclaimDelete {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	_, err := p.cfg.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	return apierrors.IsNotFound(err)
}

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
	case errors.Is(err, errExportUnresponsive):
		// An NFS server that did not answer may still create the directory; retrying adopts it.
		return nil, controller.ProvisioningInBackground, fmt.Errorf("create directory %s: %w", rel, err)
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
		err = p.locals.held(attrs.BasePath)
	}
	return m, err
}

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
		return p.exports.do(ctx, attrs.Server, attrs.Share, mountOptions, fn)
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
			return p.locals.doMounted(base, attrs.BasePath, fn)
		}
		return p.locals.do(base, attrs.BasePath, fn)
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

// Delete applies the PV's onDelete policy to its directory. A missing directory counts as
// deleted, so a retried Delete succeeds.
func (p *Provisioner) Delete(ctx context.Context, pv *v1.PersistentVolume) error {
	if why := p.responsibleFor(ctx, pv); why != "" {
		return &controller.IgnoredError{Reason: why}
	}
	logger := klog.FromContext(ctx).WithValues("pv", pv.Name)
	ctx = klog.NewContext(ctx, logger)
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	if err != nil {
		return fmt.Errorf("PV %s: %w", pv.Name, err)
	}
	attrs.BaseMountPoint = mountPointRequired(pv)
	if p.cfg.Role == RoleController && attrs.Backend == volume.BackendLocal {
		// Only a lost node's volumes get here: nobody can reach the directory any more.
		msg := fmt.Sprintf("node %s no longer exists: the PV is deleted, its data (if any) stays in %s/%s on that machine",
			pv.Annotations[AnnNode], attrs.BasePath, attrs.Path)
		logger.Info("Deleting PV of a lost node without touching its directory", "node", pv.Annotations[AnnNode])
		if p.cfg.Events != nil {
			p.cfg.Events.Event(pv, v1.EventTypeWarning, "VolumeDataOnLostNode", msg)
		}
		return nil
	}
	policy := OnDeleteDelete
	if s, ok := pv.Annotations[AnnOnDelete]; ok {
		if policy, err = parseOnDelete(s); err != nil {
			return fmt.Errorf("PV %s annotation %s: %w", pv.Name, AnnOnDelete, err)
		}
	}
	if policy == OnDeleteRetain {
		logger.Info("Kept volume directory (onDelete retain)", "path", attrs.Path)
		return nil
	}
	unlock, err := p.lockVolume(ctx, attrs)
	if err != nil {
		return fmt.Errorf("onDelete %s of %s in %s: %w", policy, attrs.Path, storeName(attrs), err)
	}
	defer unlock()
	if policy == OnDeleteDelete && attrs.Backend == volume.BackendNFS && p.exports != nil {
		// A big tree takes longer than a dead server may: only the move to the trash is
		// bounded by the operation timeout, the removal goes on in the background.
		if err := p.exports.trash(ctx, attrs.Server, attrs.Share, pv.Spec.MountOptions, attrs.Path, pv); err != nil {
			return fmt.Errorf("onDelete %s of %s in %s: %w", policy, attrs.Path, storeName(attrs), err)
		}
		return nil
	}
	// Local volumes are removed in place: a local disk has no server to wait for, and the
	// node plugin has no trash to resume from after a restart.
	err = p.onStore(ctx, attrs, pv.Spec.MountOptions, func(root *volume.Root) error {
		vol, err := checkOwnedBy(root, attrs.Path, claimOf(pv))
		if err != nil && !errors.Is(err, volume.ErrNotDirectory) {
			return err
		}
		if vol != nil {
			defer vol.Close()
		}
		failpoint.Reach(failpoint.DeleteChecked)
		switch {
		case err != nil:
			// Neither policy follows a symlink: the link itself goes, its target stays.
			err := root.RemoveLink(attrs.Path)
			if errors.Is(err, volume.ErrReplaced) {
				logger.Info("Left alone the directory made at the volume's path after its check", "path", attrs.Path)
				return nil
			}
			return err
		case policy == OnDeleteDelete:
			return removeVolume(ctx, root, attrs, vol, claimOf(pv))
		case vol == nil:
			return nil
		}
		err = vol.Rename(archiveName(attrs.Path, time.Now()))
		if errors.Is(err, volume.ErrReplaced) || isNotExist(err) {
			// Removed after the check, and another directory may have taken the path.
			logger.Info("Volume directory is gone already; left alone what is at its path now", "path", attrs.Path, "reason", err)
			return nil
		}
		return err
	})
	if errors.Is(err, volume.ErrBaseChanged) {
		err = fmt.Errorf("node %s: %w", p.cfg.NodeName, err)
		p.baseChanged(pv, err)
		return err
	}
	if err != nil {
		return fmt.Errorf("onDelete %s of %s in %s: %w", policy, attrs.Path, storeName(attrs), err)
	}
	logger.Info("Deleted volume directory", "path", attrs.Path, "onDelete", policy)
	return nil
}

// removeVolume removes vol, the volume directory of owner that checkOwnedBy found at attrs'
// path (nil: none was there), and frees its size limit, if it had one. The limit is freed also
// when the directory is gone already, for a retry after a crash between the two. What a
// removal that stopped midway left under its private name is removed too.
func removeVolume(ctx context.Context, root *volume.Root, attrs volume.Attributes, vol *volume.Volume, owner volume.Claim) error {
	var id quota.ID
	if attrs.Quota != "" {
		var err error
		if id, err = quota.ParseID(attrs.Quota); err != nil {
			return err
		}
	}
	if vol == nil {
		left, err := root.OpenRemoval(attrs.Path, owner.PVName)
		if err != nil && !isNotExist(err) {
			return err
		}
		if left != nil {
			defer left.Close()
			vol = left
			if !ownedBy(left, owner) {
				// A removal stopped (a crash) between giving another claim's volume, which had
				// taken the path, its private name and finding out: that volume goes back.
				if err := left.Rename(path.Base(attrs.Path)); err != nil {
					return fmt.Errorf("put back another claim's volume that an earlier removal of %s took: %w", attrs.Path, err)
				}
				vol = nil
			}
		}
	}
	if vol != nil {
		err := vol.Remove(owner.PVName, id)
		if err == nil || !errors.Is(err, volume.ErrReplaced) && !isNotExist(err) {
			return err
		}
		// The checked directory is gone: someone removed it after the check, and whatever is
		// at its path now is not this PV's to remove.
		klog.FromContext(ctx).Info("Volume directory is gone already; left alone what is at its path now", "path", attrs.Path, "reason", err)
	}
	if id.Kind == "" {
		return nil
	}
	return root.ReleaseQuota(id)
}

// checkOwnedBy opens the volume directory at rel and refuses it if its marker names another
// claim than owner: a stale PV's Delete, retried after its directory was removed and made anew
// for another claim of a pattern without ${pv.metadata.name}, must not destroy that claim's
// data. Directories that name no claim (made before markers recorded owners) are owner's. It
// returns nil if nothing is at rel, and an error wrapping volume.ErrNotDirectory if what is
// there is no directory. The caller acts on the directory returned, never on rel again:
// another directory may have taken that name since (volume.ErrReplaced).
func checkOwnedBy(root *volume.Root, rel string, owner volume.Claim) (*volume.Volume, error) {
	vol, err := root.OpenVolume(rel)
	if isNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if !ownedBy(vol, owner) {
		vol.Close()
		return nil, fmt.Errorf("directory %s now belongs to another claim's volume, not to this PV's claim; leaving it alone", rel)
	}
	return vol, nil
}

// ownedBy reports whether vol's marker names c, by its UID if c has one, else by its PV's
// name, or no claim at all.
func ownedBy(vol *volume.Volume, c volume.Claim) bool {
	got, _ := vol.Owner()
	if c.UID != "" {
		return got.UID == "" || got.UID == c.UID
	}
	return got.UID == "" || got.PVName == c.PVName
}

// claimOf is the claim pv's volume was made for, as far as the PV tells: its UID only if the
// PV is bound.
func claimOf(pv *v1.PersistentVolume) volume.Claim {
	c := volume.Claim{PVName: pv.Name}
	if ref := pv.Spec.ClaimRef; ref != nil {
		c.UID = string(ref.UID)
	}
	return c
}

// archiveName is the name an archived volume directory gets beside the original.
func archiveName(rel string, now time.Time) string {
	base := rel[strings.LastIndexByte(rel, '/')+1:]
	const prefix = "archived-"
	suffix := "-" + now.UTC().Format("20060102T150405Z")
	if max := volume.MaxComponentLength - len(prefix) - len(suffix); len(base) > max {
		base = base[:max]
	}
	return prefix + base + suffix
}

func ptrValue(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
