package provisioner

import (
	"crypto/sha256"
	"encoding/hex"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/dirpv/dirpv/volume"
)

// LabelNode is the label naming the node of a local volume, on its claim once the scheduler
// has placed the claim and on its PV. A node instance watches only the claims and PVs that
// carry its own name here, so that its cache and watch traffic grow with its own volumes, not
// with the cluster's. On a claim the API server sets it, in the write that places the claim,
// where deploy/'s MutatingAdmissionPolicy dirpv-node-label is installed (Kubernetes 1.36 or
// newer); dirpv controller sets it wherever that did not (it watches every claim anyway). The
// node sets it on the PVs it makes, and the controller on PVs made before the label existed.
const LabelNode = "dirpv.io/node"

// annStorageProvisioner is kube-controller-manager's PV controller's annotation that an
// external provisioner waits for.
const annStorageProvisioner = "volume.kubernetes.io/storage-provisioner"

// NodeSelector is the label selector of the claims and PVs a node instance serves.
func NodeSelector(node string) string { return LabelNode + "=" + NodeLabel(node) }

// NodeLabel is the value of LabelNode for node. A node name is a DNS subdomain, whose
// characters a label value allows, of up to 253 characters, where a label value has 63: a
// longer name is cut and made unique with a hash of the whole.
func NodeLabel(node string) string {
	if len(node) <= validation.LabelValueMaxLength {
		return node
	}
	sum := sha256.Sum256([]byte(node))
	h := hex.EncodeToString(sum[:8])
	return node[:validation.LabelValueMaxLength-len(h)-1] + "-" + h
}

// ClaimLabel returns the LabelNode value that a claim of a local WaitForFirstConsumer class of
// driver should get, and whether it should be patched now. The node is the one the scheduler
// selected, and once the claim is bound to a local PV of driver (pv, nil if unknown), the PV's,
// which is where the volume is resized. A claim handed back to the scheduler (no selected
// node) keeps its label until the scheduler chooses again: the instance it names declines the
// claim meanwhile.
//
// Every write to a claim bumps its resourceVersion, and kube-controller-manager's PV
// controller, once the claim is placed, updates it with the resourceVersion it read, to set
// the storage-provisioner annotation (setClaimProvisioner): a patch of ours landing first would
// fail that update, with a ProvisioningFailed warning on the claim. So a placed claim is
// labelled only once that annotation is there, which the lib waits for anyway. Writing the
// annotation ourselves before the placement, so that the PV controller skips its update,
// races the scheduler's update that places the claim instead: 11 of 15 pods made together
// with their claims failed to schedule once (TestClaimsWithPodsBindWithoutConflicts).
func ClaimLabel(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, pv *v1.PersistentVolume, driver string) (string, bool) {
	if class == nil || class.Provisioner != driver || class.Parameters[ParamBackend] != string(volume.BackendLocal) ||
		class.VolumeBindingMode == nil || *class.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		return "", false
	}
	node := claim.Annotations[annSelectedNode]
	bound := claim.Spec.VolumeName != ""
	if pv != nil && bound && pv.Name == claim.Spec.VolumeName {
		if n, ok := VolumeNode(pv, driver); ok {
			node = n
		}
	}
	if node == "" || claim.Labels[LabelNode] == NodeLabel(node) || !bound && claim.Annotations[annStorageProvisioner] == "" {
		return "", false
	}
	return NodeLabel(node), true
}

// VolumeNode returns the node of a local volume of driver, from the annotation dirpv has
// always written on the PV (the name; NodeLabel gives its label).
func VolumeNode(pv *v1.PersistentVolume, driver string) (string, bool) {
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver ||
		volume.Backend(pv.Spec.CSI.VolumeAttributes[volume.AttrBackend]) != volume.BackendLocal {
		return "", false
	}
	node := pv.Annotations[AnnNode]
	return node, node != ""
}
