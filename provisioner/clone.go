package provisioner

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/export"
)

// FinalizerCloningProtection keeps a claim that is being copied from being deleted before the
// copy is done. It is external-provisioner's: its CloningProtectionController, which dirpv
// controller runs, removes it once no Pending claim names the claim as its data source.
const FinalizerCloningProtection = "provisioner.storage.kubernetes.io/cloning-protection"

// AnnCopiedFrom is set on a claim whose volume started as a copy, once the copy is done. It
// says what was copied and how; setting it also makes the lib look at the claim again at
// once, rather than after its back-off, to bind the volume.
const AnnCopiedFrom = "dirpv.io/copied-from"

// kindPVC is a claim as a data source (apiGroup "").
const kindPVC = "PersistentVolumeClaim"

// sourceKind is one kind of data source.
type sourceKind struct{ apiGroup, kind string }

// sourceTree is where a new volume's contents come from, as a resolver found it.
type sourceTree struct {
	// what names the source in events and logs: "PersistentVolumeClaim ns/name".
	what string
	// attrs locate the tree: the backend, server and share or base path, and Path, the
	// tree's path beneath them.
	attrs volume.Attributes
	// mountOptions mount the source's NFS export.
	mountOptions []string
	// node holds a local source, and hostname is that node's kubernetes.io/hostname label,
	// which a pod's nodeAffinity names.
	node, hostname string
	// size is the source's size; the new claim must ask for at least as much.
	size resource.Quantity
	// protect, if set, keeps the source from going away while it is copied.
	protect func(context.Context) error
	// owner, if set, is the claim the source directory's marker must name (or name none, for
	// volumes made before markers named owners): a PV, which whoever may create PVs can
	// write, must not point a clone at another claim's data.
	owner *volume.Claim
	// snapshot names the snapshot to copy, which attrs' store holds (restore); empty for a
	// volume's directory.
	snapshot string
	// watch, if set, is who is told how the copy goes (reportCopy).
	watch *copyWatch
}

// checkSourceOwner refuses a source tree whose marker names another claim than src.owner.
func checkSourceOwner(from *volume.Root, src *sourceTree) error {
	if src.owner == nil {
		return nil
	}
	got, _, err := from.VolumeOwner(src.attrs.Path)
	if err != nil {
		return fmt.Errorf("%s: %w", src.what, err)
	}
	if got.UID != "" && got.UID != src.owner.UID {
		return fmt.Errorf("the directory %s of %s belongs to another claim's volume; refusing to copy it", src.attrs.Path, src.what)
	}
	return nil
}

// resolveSource finds the tree a data source of some kind names, in the claim's namespace.
// It returns an error that says what the user should change.
type resolveSource func(ctx context.Context, p *Provisioner, claim *v1.PersistentVolumeClaim, name string) (*sourceTree, error)

// sourceResolvers holds one resolver for each kind of data source dirpv can start a volume
// from.
var sourceResolvers = map[sourceKind]resolveSource{
	{"", kindPVC}:      resolveClaimSource,
	kindVolumeSnapshot: resolveSnapshotSource,
}

// dataSourceOf returns the claim's data source, or nil. dataSourceRef is read first: it is
// the field that can name another namespace, which dirpv refuses.
func dataSourceOf(claim *v1.PersistentVolumeClaim) (kind sourceKind, name, namespace string, ok bool) {
	if ref := claim.Spec.DataSourceRef; ref != nil {
		ns := claim.Namespace
		if ref.Namespace != nil && *ref.Namespace != "" {
			ns = *ref.Namespace
		}
		return sourceKind{ptr.Deref(ref.APIGroup, ""), ref.Kind}, ref.Name, ns, true
	}
	if ref := claim.Spec.DataSource; ref != nil {
		return sourceKind{ptr.Deref(ref.APIGroup, ""), ref.Kind}, ref.Name, claim.Namespace, true
	}
	return sourceKind{}, "", "", false
}

// checkDataSource refuses a data source no instance of dirpv can copy from, whatever the
// cluster holds: another kind, or another namespace.
func checkDataSource(claim *v1.PersistentVolumeClaim) error {
	kind, name, ns, ok := dataSourceOf(claim)
	if !ok {
		return nil
	}
	if _, known := sourceResolvers[kind]; !known {
		group := kind.apiGroup
		if group == "" {
			group = `"" (core)`
		}
		return fmt.Errorf("dataSource kind %s of apiGroup %s is not supported: dirpv starts a volume only from a %s or a %s (%s) in the claim's namespace",
			kind.kind, group, kindPVC, kindVolumeSnapshot.kind, kindVolumeSnapshot.apiGroup)
	}
	if ref := claim.Spec.DataSourceRef; ref != nil && ref.Namespace != nil && *ref.Namespace != "" {
		// Even the claim's own: the API server then leaves dataSource empty, and the cloning
		// protection, which reads only dataSource, would let the source go mid-copy.
		return fmt.Errorf("dataSourceRef names namespace %s for %s %s: cross-namespace data sources are not supported; "+
			"leave out dataSourceRef.namespace to copy from the claim's own namespace %s", ns, kind.kind, name, claim.Namespace)
	}
	return nil
}

// resolveDataSource finds the claim's source tree and checks that this instance can copy it
// into a volume of attrs: same backend, same node for local volumes, and no larger than the
// claim. It returns nil, with no error, for a claim without a data source.
func (p *Provisioner) resolveDataSource(ctx context.Context, claim *v1.PersistentVolumeClaim, attrs volume.Attributes) (*sourceTree, controller.ProvisioningState, error) {
	kind, name, _, ok := dataSourceOf(claim)
	if !ok {
		return nil, controller.ProvisioningFinished, nil
	}
	src, err := sourceResolvers[kind](ctx, p, claim, name)
	if err != nil {
		return nil, controller.ProvisioningFinished, err
	}
	if src.attrs.Backend != attrs.Backend {
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf(
			"%s is a %s volume and this claim's class makes %s volumes: a volume is copied only within one backend",
			src.what, src.attrs.Backend, attrs.Backend))
	}
	size := claim.Spec.Resources.Requests[v1.ResourceStorage]
	if size.Cmp(src.size) < 0 {
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf(
			"%s has %s, more than the %s this claim asks for: request at least %s",
			src.what, src.size.String(), size.String(), src.size.String()))
	}
	if attrs.Backend == volume.BackendLocal && src.node != p.cfg.NodeName {
		// The scheduler knows nothing of data sources: it may place the pod anywhere. A local
		// tree can only be copied where it is, so the claim goes back to the scheduler.
		return nil, controller.ProvisioningReschedule, fmt.Errorf(
			"%s lives on node %s, and a local volume is copied on the node that holds it, but the scheduler chose node %s: "+
				"make the pod that uses this claim run on node %s (for example a nodeAffinity on %s In [%s]); "+
				"asking the scheduler to choose again",
			src.what, src.node, p.cfg.NodeName, src.node, v1.LabelHostname, src.hostname)
	}
	if attrs.Backend == volume.BackendNFS && !p.servesExport(src.attrs.Server, src.attrs.Share) {
		// A PV names any server; the controller mounts only those its classes name.
		return nil, controller.ProvisioningFinished, invalid(fmt.Errorf(
			"%s is on NFS export %s, which no dirpv NFS StorageClass names: dirpv copies only from exports its classes serve",
			src.what, volume.ExportSource(src.attrs.Server, src.attrs.Share)))
	}
	return src, controller.ProvisioningFinished, nil
}

// servesExport reports whether a dirpv NFS class names server:share.
func (p *Provisioner) servesExport(server, share string) bool {
	classes, err := p.cfg.Classes.List(labels.Everything())
	if err != nil {
		return false
	}
	return slices.ContainsFunc(classes, func(c *storagev1.StorageClass) bool {
		return c.Provisioner == p.cfg.DriverName && c.Parameters[ParamBackend] == string(volume.BackendNFS) &&
			c.Parameters[ParamServer] == server && c.Parameters[ParamShare] == share
	})
}

// resolveClaimSource finds the volume of a Bound dirpv claim.
func resolveClaimSource(ctx context.Context, p *Provisioner, claim *v1.PersistentVolumeClaim, name string) (*sourceTree, error) {
	what := fmt.Sprintf("source %s %s/%s", kindPVC, claim.Namespace, name)
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	src, err := p.cfg.Client.CoreV1().PersistentVolumeClaims(claim.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		// It may yet be created: retried, but not as often as a passing failure.
		return nil, invalid(fmt.Errorf("%s does not exist", what))
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", what, err)
	}
	if src.Status.Phase != v1.ClaimBound || src.Spec.VolumeName == "" {
		// Commonly created together with its clone: retried until it binds.
		return nil, fmt.Errorf("%s is not Bound yet (it is %s): the copy starts once it is", what, src.Status.Phase)
	}
	pv, err := p.cfg.Client.CoreV1().PersistentVolumes().Get(ctx, src.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read the volume %s of %s: %w", src.Spec.VolumeName, what, err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != p.cfg.DriverName {
		return nil, invalid(fmt.Errorf("%s is bound to volume %s, which is not a %s volume: dirpv copies only its own volumes", what, pv.Name, p.cfg.DriverName))
	}
	if ref := pv.Spec.ClaimRef; ref == nil || ref.UID != src.UID {
		return nil, fmt.Errorf("volume %s is not bound to %s (yet)", pv.Name, what)
	}
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	if err != nil {
		return nil, invalid(fmt.Errorf("volume %s of %s: %w", pv.Name, what, err))
	}
	tree := &sourceTree{
		what:         what,
		attrs:        attrs,
		mountOptions: pv.Spec.MountOptions,
		node:         pv.Annotations[AnnNode],
		hostname:     affinityHostname(pv),
		size:         pv.Spec.Capacity[v1.ResourceStorage],
		protect: func(ctx context.Context) error {
			return p.protectClaim(ctx, claim.Namespace, name)
		},
		owner: &volume.Claim{UID: string(src.UID), PVName: pv.Name},
	}
	return tree, nil
}

// affinityHostname returns the hostname a local PV's node affinity names (buildPV), or its
// node's name.
func affinityHostname(pv *v1.PersistentVolume) string {
	if a := pv.Spec.NodeAffinity; a != nil && a.Required != nil {
		for _, term := range a.Required.NodeSelectorTerms {
			for _, e := range term.MatchExpressions {
				if e.Key == v1.LabelHostname && e.Operator == v1.NodeSelectorOpIn && len(e.Values) == 1 {
					return e.Values[0]
				}
			}
		}
	}
	return pv.Annotations[AnnNode]
}

// apiTimeout bounds each API call dirpv makes on its own (not through an informer or the
// lib), so that an API server that takes a request and never answers holds no worker for good:
// the lib's workers' contexts have no deadline. A variable so that a test need not wait as long.
var apiTimeout = 10 * time.Second

// protectClaim puts FinalizerCloningProtection on the claim, so that it is not deleted
// before its copy is done; a claim already being deleted is refused (the API server forbids
// new finalizers on it too).
func (p *Provisioner) protectClaim(ctx context.Context, namespace, name string) error {
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	claims := p.cfg.Client.CoreV1().PersistentVolumeClaims(namespace)
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		c, err := claims.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("read claim %s/%s to protect it while it is copied: %w", namespace, name, err)
		}
		if c.DeletionTimestamp != nil {
			return fmt.Errorf("claim %s/%s is being deleted: it cannot be copied", namespace, name)
		}
		if slices.Contains(c.Finalizers, FinalizerCloningProtection) {
			return nil
		}
		c.Finalizers = append(c.Finalizers, FinalizerCloningProtection)
		if _, err := claims.Update(ctx, c, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("protect claim %s/%s while it is copied (finalizer %s): %w", namespace, name, FinalizerCloningProtection, err)
		}
		return nil
	})
}

// copyVolume makes the claim's volume as a copy of src in the background, and returns the
// result once the copy is done. While it runs, it returns ProvisioningInBackground with an
// error saying so, which the lib records on the claim; if it could not start the copy,
// ProvisioningNoChange. discard removes a volume the copy made for nobody: the claim was
// deleted (or made anew) meanwhile, and no PV will ever name the volume.
func (p *Provisioner) copyVolume(ctx context.Context, claim *v1.PersistentVolumeClaim, src *sourceTree,
	fn func(context.Context) (made, error), discard func(made),
) (made, controller.ProvisioningState, error) {
	p.copies.mu.Lock()
	_, running := p.copies.byUID[claim.UID]
	p.copies.mu.Unlock()
	if !running && src.protect != nil {
		if err := src.protect(ctx); err != nil {
			// Nothing started.
			return made{}, controller.ProvisioningNoChange, err
		}
	}
	ns, name, uid := claim.Namespace, claim.Name, claim.UID
	src.watch = &copyWatch{what: src.what + " into the new volume", to: []*v1.ObjectReference{claimRef(claim)}}
	copyAndCheck := func(ctx context.Context) (made, error) {
		m, err := fn(ctx)
		if err == nil && p.claimGone(ns, name, uid) {
			discard(m)
			return made{}, errCopyAbandoned
		}
		return m, err
	}
	job, err := p.copies.run(ctx, uid, src.what, p.cfg.CloneTimeout, copyAndCheck, func(res made, err error, took time.Duration) {
		p.noteCopied(ns, name, src.what, res, err, took)
	}, discard)
	if err != nil {
		return made{}, controller.ProvisioningInBackground, err
	}
	if job == nil {
		return made{}, controller.ProvisioningInBackground, fmt.Errorf(
			"copying %s into the new volume in the background; the claim binds once the copy is complete", src.what)
	}
	if job.err != nil {
		// The result says how far the copy got.
		return job.result, controller.ProvisioningFinished, fmt.Errorf("copy %s: %w", src.what, job.err)
	}
	klog.FromContext(ctx).Info("Copied data source into the new volume", "source", src.what,
		"copy", describeCopy(job.result.stats, time.Since(job.started)))
	return job.result, controller.ProvisioningFinished, nil
}

// claimRef is the reference of an event on the claim.
func claimRef(c *v1.PersistentVolumeClaim) *v1.ObjectReference {
	return &v1.ObjectReference{Kind: kindPVC, APIVersion: "v1", Namespace: c.Namespace, Name: c.Name, UID: c.UID}
}

// claimGone reports whether the claim of uid no longer exists (deleted, or made anew under
// the same name), so that the volume copied for it is nobody's. A failed read keeps it.
func (p *Provisioner) claimGone(namespace, name string, uid types.UID) bool {
	ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
	defer cancel()
	c, err := p.cfg.Client.CoreV1().PersistentVolumeClaims(namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return true
	}
	if err != nil {
		klog.Background().Error(err, "Checking that a copied volume's claim still exists", "claim", klog.KRef(namespace, name))
		return false
	}
	return c.UID != uid
}

// discardVolume removes the volume made for owner, a claim that is gone; nothing else would,
// since no PV names it.
func (p *Provisioner) discardVolume(logger klog.Logger, attrs volume.Attributes, mountOptions []string, owner volume.Claim, m made) {
	if !m.created {
		return
	}
	attrs.Quota = m.quota
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.CloneTimeout)
	defer cancel()
	unlock, err := p.lockVolume(ctx, attrs)
	switch {
	case err == nil && attrs.Backend == volume.BackendNFS && p.exports != nil:
		// A whole copy, removed in the background as Delete removes a volume: removing it in
		// one call would outlast the operation timeout and have the export taken for dead.
		err = p.exports.Trash(ctx, attrs.Server, attrs.Share, mountOptions, attrs.Path, owner)
		unlock()
	case err == nil:
		err = p.onStore(ctx, attrs, mountOptions, func(root *volume.Root) error {
			vol, err := root.OpenVolumeOf(attrs.Path, owner)
			if err != nil {
				return err
			}
			if vol != nil {
				defer vol.Close()
			}
			return removeVolume(ctx, root, attrs, vol, owner)
		})
		unlock()
	}
	if err != nil {
		logger.Error(err, "Removing a copied volume nobody will use", "path", attrs.Path)
		return
	}
	logger.Info("Discarded a copied volume nobody will use", "path", attrs.Path)
}

// noteCopied records on the claim that its background copy ended, which makes the lib call
// Provision again at once instead of after its back-off.
func (p *Provisioner) noteCopied(namespace, name, what string, res made, copyErr error, took time.Duration) {
	note := fmt.Sprintf("%s: %s", what, describeCopy(res.stats, took))
	if copyErr != nil {
		note = fmt.Sprintf("%s: failed after %s, retrying", what, took.Round(time.Millisecond))
	}
	ctx, cancel := context.WithTimeout(context.Background(), apiTimeout)
	defer cancel()
	claims := p.cfg.Client.CoreV1().PersistentVolumeClaims(namespace)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		c, err := claims.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if c.Annotations == nil {
			c.Annotations = map[string]string{}
		}
		c.Annotations[AnnCopiedFrom] = note
		_, err = claims.Update(ctx, c, metav1.UpdateOptions{})
		return err
	})
	if err != nil && !apierrors.IsNotFound(err) {
		// The lib still calls again after its back-off.
		klog.Background().Error(err, "Recording a finished copy on its claim", "claim", klog.KRef(namespace, name))
	}
}

// describeCopy says what a copy made and how, for people.
func describeCopy(st volume.CopyStats, took time.Duration) string {
	d := fmt.Sprintf("%d files, %d directories, %d symlinks, %d hard links, %s, by %s, in %s",
		st.Files, st.Dirs, st.Symlinks, st.HardLinks, resource.NewQuantity(st.Bytes, resource.BinarySI).String(),
		st.Method, took.Round(time.Millisecond))
	if st.SkippedDevices > 0 {
		d += fmt.Sprintf("; %d device nodes left out", st.SkippedDevices)
	}
	if st.XattrsSkipped > 0 {
		d += fmt.Sprintf("; %d extended attributes the target does not support left out", st.XattrsSkipped)
	}
	return d
}

// onStores runs fn, a copy, on the root of the volume's store and the root of the source's,
// which may be the same, with ctx bounded by the caller. A local copy first waits for one
// of the node's copy slots (Config.MaxLocalCopies), an NFS copy for one of the export's;
// either counts as waiting until fn starts, then as running until fn returns.
func (p *Provisioner) onStores(ctx context.Context, attrs volume.Attributes, mountOptions []string, src *sourceTree,
	fn func(ctx context.Context, root, from *volume.Root) error,
) error {
	copyFn := fn
	fn, done := p.copying.track(func(ctx context.Context, root, from *volume.Root) error {
		ctx, stop := reportCopy(ctx, p.cfg.Events, src.watch)
		defer stop()
		return copyFn(ctx, root, from)
	})
	defer done()
	switch attrs.Backend {
	case volume.BackendNFS:
		if p.exports == nil {
			return fmt.Errorf("NFS volumes are handled by dirpv controller, not on a node")
		}
		return p.exports.DoPair(ctx, p.cfg.CloneTimeout,
			export.Ref{Server: attrs.Server, Share: attrs.Share, Options: mountOptions},
			export.Ref{Server: src.attrs.Server, Share: src.attrs.Share, Options: src.mountOptions}, fn)
	case volume.BackendLocal:
		slot, err := p.localCopies.Acquire(ctx)
		if err != nil {
			return fmt.Errorf("waiting for one of the node's %d copy slots (--max-local-copies): %w", p.localCopies.Size(), err)
		}
		defer slot.Release()
		return p.onStore(ctx, src.attrs, nil, func(from *volume.Root) error {
			return p.onStore(ctx, attrs, nil, func(root *volume.Root) error { return fn(ctx, root, from) })
		})
	}
	return fmt.Errorf("unknown backend %q", attrs.Backend)
}

// copyGauge counts the copies running and those waiting to run, for metrics.
type copyGauge struct{ running, waiting atomic.Int64 }

// track counts a copy as waiting until the fn it returns is called, then as running until
// that returns. done ends a copy whose fn never started; an NFS copy abandoned by its caller
// still runs after done, and counts as running until it returns.
func (g *copyGauge) track(fn func(context.Context, *volume.Root, *volume.Root) error) (func(context.Context, *volume.Root, *volume.Root) error, func()) {
	g.waiting.Add(1)
	var waiting atomic.Bool
	waiting.Store(true)
	stopWaiting := func() {
		if waiting.CompareAndSwap(true, false) {
			g.waiting.Add(-1)
		}
	}
	return func(ctx context.Context, root, from *volume.Root) error {
		stopWaiting()
		g.running.Add(1)
		defer g.running.Add(-1)
		return fn(ctx, root, from)
	}, stopWaiting
}
