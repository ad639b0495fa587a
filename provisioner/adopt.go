package provisioner

import (
	"context"
	"encoding/json"
	"fmt"
	"path"
	"slices"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume"
)

// AnnProvisionedBy names the provisioner that made a PV (set by every external provisioner).
const AnnProvisionedBy = "pv.kubernetes.io/provisioned-by"

// Adopted PVs are those another provisioner made (Config.Adopt): nfs-subdir-external-
// provisioner's in-tree nfs PVs, local-path-provisioner's hostPath and local PVs. dirpv applies
// their reclaim once that provisioner is gone, and finds where their directory is and what to
// do with it exactly as it does for its own, from a dirpv StorageClass: the one that replaced
// theirs under the same name (a class's provisioner cannot change). Until then, or if the
// directory is not inside that class's share or base path, Delete fails with the reason (the
// lib's VolumeFailedDelete event on the PV) and touches nothing; the lib retries.

// adopts says whether pv is another provisioner's that this instance takes over.
func (p *Provisioner) adopts(pv *v1.PersistentVolume) bool {
	return pv.Spec.CSI == nil && len(p.cfg.Adopt) > 0 && slices.Contains(p.cfg.Adopt, pv.Annotations[AnnProvisionedBy])
}

// adoptedVolume returns where the directory of pv, an adopted PV, is and its onDelete, from the
// dirpv class of pv's class name.
func (p *Provisioner) adoptedVolume(pv *v1.PersistentVolume) (volume.Attributes, OnDelete, error) {
	by, className := pv.Annotations[AnnProvisionedBy], pv.Spec.StorageClassName
	class, err := p.cfg.Classes.Get(className)
	if err != nil {
		return volume.Attributes{}, "", fmt.Errorf("PV %s of %s: StorageClass %q: %w; it is deleted once a dirpv class of that name says where its directory is", pv.Name, by, className, err)
	}
	if class.Provisioner != p.cfg.DriverName {
		return volume.Attributes{}, "", fmt.Errorf("PV %s of %s: StorageClass %q is still %s's, not a %s class: the directory is left alone until a %s class of that name replaces it",
			pv.Name, by, className, class.Provisioner, p.cfg.DriverName, p.cfg.DriverName)
	}
	params, err := parseParameters(class.Parameters)
	if err != nil {
		return volume.Attributes{}, "", fmt.Errorf("PV %s of %s: StorageClass %s: %w", pv.Name, by, className, err)
	}
	attrs := volume.Attributes{Backend: params.backend, Server: params.server, Share: params.share, BasePath: params.basePath, BaseMountPoint: params.mountPoint}
	var dir, root string
	switch src := pv.Spec.PersistentVolumeSource; {
	case src.NFS != nil && params.backend == volume.BackendNFS:
		if src.NFS.Server != params.server {
			return volume.Attributes{}, "", fmt.Errorf("PV %s of %s is on NFS server %s, StorageClass %s names server %s: dirpv does not touch it",
				pv.Name, by, volume.Quote(src.NFS.Server), className, volume.Quote(params.server))
		}
		dir, root = src.NFS.Path, params.share
	case src.HostPath != nil && params.backend == volume.BackendLocal:
		dir, root = src.HostPath.Path, params.basePath
	case src.Local != nil && params.backend == volume.BackendLocal:
		dir, root = src.Local.Path, params.basePath
	default:
		return volume.Attributes{}, "", fmt.Errorf("PV %s of %s: its volume source is not one a %s class of backend %s serves (nfs; hostPath or local)",
			pv.Name, by, p.cfg.DriverName, params.backend)
	}
	// Only a clean path strictly inside the class's share or base: no "..", no trick that
	// path.Clean would turn into another directory than the one the PV names.
	rel, ok := beneath(root, dir)
	if !ok {
		return volume.Attributes{}, "", fmt.Errorf("PV %s of %s: directory %s is not inside %s of StorageClass %s: dirpv does not touch it",
			pv.Name, by, volume.Quote(dir), volume.Quote(root), className)
	}
	attrs.Path = rel
	if err := attrs.Validate(); err != nil {
		return volume.Attributes{}, "", fmt.Errorf("PV %s of %s: %w", pv.Name, by, err)
	}
	return attrs, params.onDelete, nil
}

// beneath returns dir relative to root if dir is a clean absolute path strictly inside root.
func beneath(root, dir string) (string, bool) {
	if !path.IsAbs(dir) || path.Clean(dir) != dir || root == "/" {
		return "", false
	}
	if len(dir) <= len(root)+1 || dir[:len(root)+1] != root+"/" {
		return "", false
	}
	return dir[len(root)+1:], true
}

// placeAdopted gives an adopted local PV the node annotation and label of dirpv's own local
// PVs, so that its node's instance, which sees only PVs labelled for it, deletes it, as the
// node's credentials may (deploy/components/node-write-policy). The node is the one whose
// kubernetes.io/hostname label its node affinity names, as local-path-provisioner sets it.
// A PV whose hostname no node (or more than one) has stays as it is, logged.
func (p *Provisioner) placeAdopted(ctx context.Context, pv *v1.PersistentVolume) {
	if p.cfg.Role != RoleController || !p.adopts(pv) || pv.Spec.NFS != nil || pv.Annotations[AnnNode] != "" {
		return
	}
	logger := klog.FromContext(ctx).WithValues("pv", pv.Name)
	hostname := affinityHostname(pv)
	if hostname == "" || len(validation.IsValidLabelValue(hostname)) > 0 {
		logger.Info("Adopted local PV names no node's hostname in its node affinity: left to no node", "hostname", hostname, "provisionedBy", pv.Annotations[AnnProvisionedBy])
		return
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	nodes, err := p.cfg.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: labels.Set{v1.LabelHostname: hostname}.String()})
	if err != nil || len(nodes.Items) != 1 {
		n := 0
		if err == nil {
			n = len(nodes.Items)
		}
		logger.Info("Adopted local PV left to no node: want one node with the hostname its node affinity names", "hostname", hostname, "nodes", n, "err", err)
		return
	}
	node := nodes.Items[0]
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{AnnNode: node.Name},
		"labels":      map[string]string{LabelNode: NodeLabel(node.Name)},
	}})
	if err != nil {
		logger.Error(err, "Adopted local PV left to no node")
		return
	}
	if _, err := p.cfg.Client.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		logger.Error(err, "Adopted local PV left to no node for now: it is tried again on its next update or resync", "node", node.Name)
		return
	}
	logger.Info("Adopted local PV handed to its node", "node", node.Name, "provisionedBy", pv.Annotations[AnnProvisionedBy])
}
