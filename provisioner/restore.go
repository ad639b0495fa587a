package provisioner

import (
	"context"
	"fmt"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/volume"
)

// kindVolumeSnapshot is a VolumeSnapshot as a data source.
var kindVolumeSnapshot = sourceKind{snapshotv1.GroupName, "VolumeSnapshot"}

// resolveSnapshotSource finds the snapshot a ready VolumeSnapshot of dirpv's stands for:
// through the VolumeSnapshotContent bound to it, whose handle locates it (Snapshotter).
func resolveSnapshotSource(ctx context.Context, p *Provisioner, claim *v1.PersistentVolumeClaim, name string) (*sourceTree, error) {
	what := fmt.Sprintf("source VolumeSnapshot %s/%s", claim.Namespace, name)
	if p.cfg.Snapshots == nil {
		return nil, invalid(fmt.Errorf("%s: this dirpv runs without the snapshot API", what))
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	vs, err := p.cfg.Snapshots.SnapshotV1().VolumeSnapshots(claim.Namespace).Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		// It may yet be created: retried, but not as often as a passing failure.
		return nil, invalid(fmt.Errorf("%s does not exist", what))
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", what, err)
	}
	st := vs.Status
	if st != nil && st.Error != nil && st.Error.Message != nil {
		return nil, fmt.Errorf("%s failed: %s; the restore starts once it is ready", what, *st.Error.Message)
	}
	if st == nil || st.BoundVolumeSnapshotContentName == nil || st.ReadyToUse == nil || !*st.ReadyToUse {
		// Commonly created together with its restore: retried until the copy is complete.
		return nil, fmt.Errorf("%s is not ready to use yet (its snapshot is still being made): the restore starts once it is", what)
	}
	content, err := p.cfg.Snapshots.SnapshotV1().VolumeSnapshotContents().Get(ctx, *st.BoundVolumeSnapshotContentName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read VolumeSnapshotContent %s of %s: %w", *st.BoundVolumeSnapshotContentName, what, err)
	}
	// A content names its VolumeSnapshot too: the binding holds only if both agree.
	if ref := content.Spec.VolumeSnapshotRef; ref.UID != vs.UID || ref.Namespace != vs.Namespace || ref.Name != vs.Name {
		return nil, fmt.Errorf("VolumeSnapshotContent %s is not bound to %s", content.Name, what)
	}
	if content.Spec.Driver != p.cfg.DriverName {
		return nil, invalid(fmt.Errorf("%s is a snapshot of driver %s: dirpv restores only its own snapshots", what, content.Spec.Driver))
	}
	handle := content.Spec.Source.SnapshotHandle
	if content.Status != nil && content.Status.SnapshotHandle != nil {
		handle = content.Status.SnapshotHandle
	}
	if handle == nil {
		return nil, fmt.Errorf("VolumeSnapshotContent %s of %s has no snapshot handle yet", content.Name, what)
	}
	h, err := volume.ParseSnapshotHandle(*handle)
	if err != nil {
		return nil, invalid(fmt.Errorf("VolumeSnapshotContent %s of %s: %w", content.Name, what, err))
	}
	size := *resource.NewQuantity(h.Size, resource.BinarySI)
	if st.RestoreSize != nil && st.RestoreSize.Cmp(size) > 0 {
		size = *st.RestoreSize
	}
	hostname := h.Node
	if h.Backend == volume.BackendLocal {
		get, cancel := context.WithTimeout(ctx, apiTimeout)
		node, err := p.cfg.Client.CoreV1().Nodes().Get(get, h.Node, metav1.GetOptions{})
		cancel()
		if err == nil && node.Labels[v1.LabelHostname] != "" {
			hostname = node.Labels[v1.LabelHostname]
		}
	}
	return &sourceTree{
		what:         what,
		attrs:        h.Store(h.Name),
		mountOptions: h.MountOptions,
		node:         h.Node,
		hostname:     hostname,
		size:         size,
		snapshot:     h.Name,
	}, nil
}

// in returns the tree to copy from in from, the root of src's store: a snapshot's, or the
// directory at src.attrs.Path.
func (src *sourceTree) in(from *volume.Root) volume.Source {
	if src.snapshot != "" {
		return from.SnapshotSource(src.snapshot)
	}
	return volume.Source{Root: from, Rel: src.attrs.Path}
}
