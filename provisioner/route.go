package provisioner

import (
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/dirpv/dirpv/volume"
)

// LabelNode is the label naming the node of a local volume, on its claim once the scheduler
// has placed the claim and on its PV. A node instance watches only the claims and PVs that
// carry its own name here, so that its cache and watch traffic grow with its own volumes, not
// with the cluster's. dirpv controller sets it on claims (it watches every claim anyway); the
// node sets it on the PVs it makes, and the controller on PVs made before the label existed.
const LabelNode = "dirpv.io/node"

// Annotations of kube-controller-manager's PV controller that an external provisioner waits for.
const (
	annStorageProvisioner     = "volume.kubernetes.io/storage-provisioner"
	annBetaStorageProvisioner = "volume.beta.kubernetes.io/storage-provisioner"
)

// NodeSelector is the label selector of the claims and PVs a node instance serves.
func NodeSelector(node string) string { return LabelNode + "=" + node }

// ClaimRouting returns the labels and annotations that a claim of a local WaitForFirstConsumer
// class of driver lacks, or nil maps if it lacks none or is not such a claim:
//   - once the scheduler has selected a node, LabelNode naming it, so that the node's
//     instance sees the claim; once the claim is bound to a local PV of driver (pv, nil if
//     unknown), the PV's node, which is where the volume is resized. A claim handed back to the scheduler (no selected node) keeps
//     the label it has: the scheduler's next update of the claim must not race a patch of
//     ours, and the instance it names declines the claim until the scheduler has chosen again.
//   - before a node is selected, the storage-provisioner annotations that kube-controller-
//     manager's PV controller would write after the selection (setClaimProvisioner, the GA
//     and the beta key), so that the lib starts as soon as the claim is placed and the PV
//     controller, finding them there, skips its own write. Not once a node is selected: the
//     PV controller then updates the claim with the resourceVersion it read, and a patch of
//     ours landing first would fail its update (a ProvisioningFailed warning on the claim).
//     Before the selection it does not touch the claim.
func ClaimRouting(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, pv *v1.PersistentVolume, driver string) (labels, annotations map[string]string) {
	if class == nil || class.Provisioner != driver || class.Parameters[ParamBackend] != string(volume.BackendLocal) ||
		class.VolumeBindingMode == nil || *class.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		return nil, nil
	}
	node := claim.Annotations[annSelectedNode]
	if pv != nil && pv.Name == claim.Spec.VolumeName {
		if n, ok := VolumeNode(pv, driver); ok {
			node = n
		}
	}
	if node != "" && claim.Labels[LabelNode] != node {
		labels = map[string]string{LabelNode: node}
	}
	if node == "" && claim.Spec.VolumeName == "" {
		for _, k := range []string{annStorageProvisioner, annBetaStorageProvisioner} {
			if claim.Annotations[k] == "" {
				if annotations == nil {
					annotations = map[string]string{}
				}
				annotations[k] = driver
			}
		}
	}
	return labels, annotations
}

// VolumeNode returns the node of a local volume of driver, from the annotation dirpv has
// always written on the PV.
func VolumeNode(pv *v1.PersistentVolume, driver string) (string, bool) {
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver ||
		volume.Backend(pv.Spec.CSI.VolumeAttributes[volume.AttrBackend]) != volume.BackendLocal {
		return "", false
	}
	node := pv.Annotations[AnnNode]
	return node, node != ""
}
