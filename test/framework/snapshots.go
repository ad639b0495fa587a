package framework

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapclientset "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/dirpv/dirpv/test/deploy"
)

// InstallSnapshotCRDs applies the VolumeSnapshot CRDs of deploy/components/snapshots, as the
// component would, and waits until the API server serves them. It returns a client of the
// snapshot API.
func InstallSnapshotCRDs(ctx context.Context, kubeconfig string) (snapclientset.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	files, err := filepath.Glob(filepath.Join(RepoRoot(), "deploy", "components", "snapshots", "crds", "*.yaml"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("snapshot CRDs: %d files (%v)", len(files), err)
	}
	inst, err := newInstallation(cfg, nil)
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		objs, err := deploy.Decode(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		for _, o := range objs {
			if err := inst.apply(ctx, o); err != nil {
				return nil, err
			}
		}
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, err
	}
	err = Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
		list, err := dc.ServerResourcesForGroupVersion(snapshotv1.SchemeGroupVersion.String())
		return err == nil && len(list.APIResources) >= 3, nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot CRDs not served: %w", err)
	}
	return snapclientset.NewForConfig(cfg)
}
