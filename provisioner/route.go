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

// ClaimNode returns the node whose instance serves the claim, if the claim belongs on one: a
// claim of a local WaitForFirstConsumer class of driver, with a selected node. A claim handed
// back to the scheduler (no selected node) keeps the label it has: the scheduler's next update
// of the claim must not race a patch of ours, and the instance it names declines the claim
// until the scheduler has chosen again.
func ClaimNode(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, driver string) (string, bool) {
	if class == nil || class.Provisioner != driver || class.Parameters[ParamBackend] != string(volume.BackendLocal) ||
		class.VolumeBindingMode == nil || *class.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		return "", false
	}
	node := claim.Annotations[annSelectedNode]
	return node, node != ""
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
