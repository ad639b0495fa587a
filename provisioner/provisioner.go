// Package provisioner is dirpv's sig-storage-lib-external-provisioner Provisioner: it turns a
// claim into a directory on an NFS export or under a node-local base path, and back.
//
// One Provisioner runs in `dirpv controller` (role controller, leader-elected) for NFS classes
// and in every `dirpv node` (role node, no leader election) for local classes, where it accepts
// only the claims the scheduler placed on its own node.
package provisioner

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/internal/blocking"
	"github.com/dirpv/dirpv/internal/keyed"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
	"github.com/dirpv/dirpv/volume/local"
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
	// CopySpaceMargin is the free space, in bytes, that a copy (a clone, a restore, a
	// snapshot) must leave on its base beyond the space its source occupies; a copy that would
	// not is not started (volume.ErrNoRoomForCopy) and is tried again later.
	CopySpaceMargin uint64
	// MaxLocalCopies caps the copies of local volumes (clones, restores, snapshots) running
	// at once on the node (role node); 0 means DefaultMaxLocalCopies. The others wait for a
	// slot, within their CloneTimeout. NFS copies have a cap per export instead (export).
	MaxLocalCopies int
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
	// Adopt names other provisioners whose PVs dirpv deletes, retains or archives in their
	// place (adopt.go); the lib must be given the same names.
	Adopt []string
}

// Provisioner implements controller.Provisioner, Qualifier and DeletionGuard.
type Provisioner struct {
	cfg     Config
	exports *export.Exports
	locals  local.Bases
	// nodePlugins rate-limits the controller's checks for a missing node plugin.
	nodePlugins nodePluginChecks
	// unplaced rate-limits the controller's checks of local claims no node can serve.
	unplaced claimChecks
	// copies are the copies under way that start volumes from data sources.
	copies *copyJobs
	// localCopies caps the local copies running at once (Config.MaxLocalCopies); copying
	// counts the copies running and waiting, of either backend (onStores).
	localCopies *blocking.Slots
	copying     copyGauge
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
	if cfg.MaxLocalCopies <= 0 {
		cfg.MaxLocalCopies = DefaultMaxLocalCopies
	}
	p := &Provisioner{cfg: cfg, copies: newCopyJobs(), localCopies: blocking.NewSlots(cfg.MaxLocalCopies)}
	if cfg.Role == RoleController {
		p.exports = export.New(cfg.Mounter, cfg.WorkDir, cfg.OperationTimeout)
	} else {
		p.locals.Records = volume.NewBaseRecords(filepath.Join(cfg.StateDir, "bases"))
	}
	return p, nil
}

// DefaultCloneTimeout is the default of Config.CloneTimeout.
const DefaultCloneTimeout = 6 * time.Hour

// DefaultMaxLocalCopies is the default of Config.MaxLocalCopies: a copy holds a few MiB at
// most (volume.MkdirAllFrom), and a few at once keep a disk busy.
const DefaultMaxLocalCopies = 4

// Run unmounts idle NFS exports (role controller) or checks local volumes for quota escapes
// (role node) until ctx is done, then stops the copies under way and releases every mount and
// directory.
func (p *Provisioner) Run(ctx context.Context) {
	defer p.locals.Close()
	if p.exports != nil {
		defer p.exports.Close(context.WithoutCancel(ctx))
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
			p.exports.Sweep(ctx, p.cfg.IdleUnmount)
		}
	}
}

// PendingDeletes counts the NFS volumes that Delete moved to the trash and whose trees are
// still being removed in the background.
func (p *Provisioner) PendingDeletes() int {
	if p.exports == nil {
		return 0
	}
	return p.exports.PendingDeletes()
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
	className := ptr.Deref(claim.Spec.StorageClassName, "")
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
	// The lib asks this of every PV it syncs, released or not: an adopted local PV reaches
	// its node long before it is deleted.
	p.placeAdopted(ctx, pv)
	return p.responsibleFor(ctx, pv) == ""
}

// responsibleFor returns why this instance does not handle the PV, or "" if it does.
func (p *Provisioner) responsibleFor(ctx context.Context, pv *v1.PersistentVolume) string {
	var backend volume.Backend
	switch {
	case p.adopts(pv) && pv.Spec.NFS != nil:
		backend = volume.BackendNFS
	case p.adopts(pv):
		// Only the node it was handed to (placeAdopted) deletes an adopted local PV.
		if p.cfg.Role == RoleController {
			return fmt.Sprintf("PV %s is a local volume of %s, deleted on its node", pv.Name, pv.Annotations[AnnProvisionedBy])
		}
		backend = volume.BackendLocal
	case pv.Spec.CSI == nil || pv.Spec.CSI.Driver != p.cfg.DriverName:
		return fmt.Sprintf("PV %s is not a %s volume", pv.Name, p.cfg.DriverName)
	default:
		backend = volume.Backend(pv.Spec.CSI.VolumeAttributes[volume.AttrBackend])
	}
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
