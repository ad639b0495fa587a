package provisioner

import (
	"context"
	"errors"
	"fmt"
	"path"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota"
)

// Delete applies the PV's onDelete policy to its directory. A missing directory counts as
// deleted, so a retried Delete succeeds.
func (p *Provisioner) Delete(ctx context.Context, pv *v1.PersistentVolume) error {
	if why := p.responsibleFor(ctx, pv); why != "" {
		return &controller.IgnoredError{Reason: why}
	}
	logger := klog.FromContext(ctx).WithValues("pv", pv.Name)
	ctx = klog.NewContext(ctx, logger)
	attrs, policy, err := p.deletion(pv)
	if err != nil {
		return err
	}
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
		if err := p.exports.Trash(ctx, attrs.Server, attrs.Share, pv.Spec.MountOptions, attrs.Path, claimOf(pv)); err != nil {
			return fmt.Errorf("onDelete %s of %s in %s: %w", policy, attrs.Path, storeName(attrs), err)
		}
		return nil
	}
	// Local volumes are removed in place: a local disk has no server to wait for, and the
	// node plugin has no trash to resume from after a restart.
	err = p.onStore(ctx, attrs, pv.Spec.MountOptions, func(root *volume.Root) error {
		vol, err := root.OpenVolumeOf(attrs.Path, claimOf(pv))
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

// deletion returns where pv's directory is and its onDelete policy: from the PV alone for
// dirpv's own, from the class for an adopted one (adoptedVolume).
func (p *Provisioner) deletion(pv *v1.PersistentVolume) (volume.Attributes, OnDelete, error) {
	if p.adopts(pv) {
		return p.adoptedVolume(pv)
	}
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	if err != nil {
		return volume.Attributes{}, "", fmt.Errorf("PV %s: %w", pv.Name, err)
	}
	attrs.BaseMountPoint = mountPointRequired(pv)
	policy := OnDeleteDelete
	if s, ok := pv.Annotations[AnnOnDelete]; ok {
		if policy, err = parseOnDelete(s); err != nil {
			return volume.Attributes{}, "", fmt.Errorf("PV %s annotation %s: %w", pv.Name, AnnOnDelete, err)
		}
	}
	return attrs, policy, nil
}

// removeVolume removes vol, the volume directory of owner that Root.OpenVolumeOf found at attrs'
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
			if !left.OwnedBy(owner) {
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
