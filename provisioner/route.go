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
// with the cluster's. dirpv controller sets it on claims (it watches every claim anyway); the
// node sets it on the PVs it makes, and the controller on PVs made before the label existed.
const LabelNode = "dirpv.io/node"

// Annotations of kube-controller-manager's PV controller that an external provisioner waits for.
const (
	annStorageProvisioner     = "volume.kubernetes.io/storage-provisioner"
	annBetaStorageProvisioner = "volume.beta.kubernetes.io/storage-provisioner"
)

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

// ClaimRouting returns the labels and annotations that a claim of a local WaitForFirstConsumer
// class of driver lacks, or nil maps if it lacks none, is not such a claim, or must not be
// patched now. Every write to a claim bumps its resourceVersion, and the scheduler and
// kube-controller-manager's PV controller update claims with the resourceVersion they read:
// a patch of ours landing between their read and their write fails their update (a
// FailedScheduling or ProvisioningFailed warning, and a retry). So each key is written while
// nobody else is about to write the claim:
//   - before the scheduler selects a node, the storage-provisioner annotations that the PV
//     controller writes after the selection (setClaimProvisioner; the GA and the beta key,
//     as it writes both). Finding them, the PV controller skips its own update of the
//     claim: one write fewer of its limited budget, and none left to race the label.
//   - once a node is selected and the annotation is there, LabelNode naming the node, so
//     that its instance sees the claim. A claim placed before dirpv could annotate it (made
//     with a selected node) waits for the PV controller's annotation first, which the lib
//     waits for anyway. Once the claim is bound to a local PV of driver (pv, nil if unknown),
//     the PV's node, which is where the volume is resized. A claim handed back to the
//     scheduler (no selected node) keeps its label until the scheduler chooses again: the
//     instance it names declines the claim meanwhile.
func ClaimRouting(claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, pv *v1.PersistentVolume, driver string) (labels, annotations map[string]string) {
	if class == nil || class.Provisioner != driver || class.Parameters[ParamBackend] != string(volume.BackendLocal) ||
		class.VolumeBindingMode == nil || *class.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		return nil, nil
	}
	node := claim.Annotations[annSelectedNode]
	bound := claim.Spec.VolumeName != ""
	if pv != nil && bound && pv.Name == claim.Spec.VolumeName {
		if n, ok := VolumeNode(pv, driver); ok {
			node = n
		}
	}
	if node != "" && claim.Labels[LabelNode] != NodeLabel(node) && (bound || claim.Annotations[annStorageProvisioner] != "") {
		labels = map[string]string{LabelNode: NodeLabel(node)}
	}
	if node == "" && !bound {
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
// always written on the PV (the name; NodeLabel gives its label).
func VolumeNode(pv *v1.PersistentVolume, driver string) (string, bool) {
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver ||
		volume.Backend(pv.Spec.CSI.VolumeAttributes[volume.AttrBackend]) != volume.BackendLocal {
		return "", false
	}
	node := pv.Annotations[AnnNode]
	return node, node != ""
}
