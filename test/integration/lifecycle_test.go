package integration

// Lifecycle of a claim beyond the happy path: the PV deleted before its claim, and a node that
// cannot hold the volume.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// pvFinalizer is the lib's finalizer, which makes onDelete run whichever of PV and claim goes
// first.
const pvFinalizer = "external-provisioner.volume.kubernetes.io/finalizer"

// lifecycleBackend makes a class of one backend and tells where its volumes land on disk.
type lifecycleBackend struct {
	name string
	// class creates a class with the given parameters and returns it with the directory
	// holding its volumes.
	class func(t *testing.T, params map[string]string) (className, dir string)
	claim []framework.ClaimOption
}

func lifecycleBackends() []lifecycleBackend {
	return []lifecycleBackend{
		{
			name: "local",
			class: func(t *testing.T, params map[string]string) (string, string) {
				c, base := localClass(t, params)
				return c.Name, base
			},
			claim: []framework.ClaimOption{framework.OnNode(nodeA)},
		},
		{
			name: "nfs",
			class: func(t *testing.T, params map[string]string) (string, string) {
				c := nfsClass(t, suite.NFS, []string{"nolock"}, params)
				return c.Name, suite.NFS.ExportDir
			},
			claim: []framework.ClaimOption{framework.AccessModes(v1.ReadWriteMany)},
		},
	}
}

// A PV the user deletes before its claim waits while the claim is still bound, and the class's
// onDelete runs on the directory once both are gone. (Deleting the claim alone: the VM tier's
// TestNFSReclaimOnGuestNode on NFS, test/e2e/install's TestExamplesRunAsWritten on local.)
func TestDeletionOrderRunsOnDelete(t *testing.T) {
	for _, b := range lifecycleBackends() {
		for _, onDelete := range []string{"delete", "retain"} {
			t.Run(b.name+"/pv-first-"+onDelete, func(t *testing.T) {
				ctx := context.Background()
				ns := suite.NewNamespace(t)
				class, dir := b.class(t, map[string]string{"onDelete": onDelete})
				suite.CreateClaim(t, ns, "c", class, b.claim...)
				_, pv := waitBound(t, ns, "c")
				volDir := filepath.Join(dir, pv.Spec.CSI.VolumeAttributes["path"])
				must(t, os.WriteFile(filepath.Join(volDir, "data"), []byte("x"), 0o644))
				if !slices.Contains(pv.Finalizers, pvFinalizer) {
					t.Errorf("PV finalizers = %v, want %s", pv.Finalizers, pvFinalizer)
				}

				must(t, suite.Client.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}))
				// The PV is marked for deletion but stays while its claim is bound, and
				// nothing happens to the data yet.
				err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
					got, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
					return err == nil && got.DeletionTimestamp != nil, err
				})
				must(t, err)
				if _, err := os.Stat(filepath.Join(volDir, "data")); err != nil {
					t.Fatalf("data of a still-bound claim: %v", err)
				}
				deleteClaim(t, ns, "c")
				waitPVGone(t, pv.Name)

				if _, err := os.Stat(volDir); onDelete == "delete" && !os.IsNotExist(err) {
					t.Errorf("volume directory %s after onDelete delete: %v (want it gone)", volDir, err)
				}
				if _, err := os.Stat(filepath.Join(volDir, "data")); onDelete == "retain" && err != nil {
					t.Errorf("volume data after onDelete retain: %v (want it kept)", err)
				}
			})
		}
	}
}

// A node whose base path is read-only cannot hold the volume: dirpv says so, naming the node,
// and hands the claim back to the scheduler by removing its selected node.
func TestReadOnlyBaseReschedules(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class, base := localClass(t, nil)
	must(t, os.MkdirAll(base, 0o755))
	if err := unix.Mount(base, base, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount %s: %v", base, err)
	}
	// Lazily: node-a's dirpv keeps the base open.
	t.Cleanup(func() {
		if err := unix.Unmount(base, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", base, err)
		}
	})
	if err := unix.Mount("", base, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		t.Fatalf("remount %s read-only: %v", base, err)
	}

	suite.CreateClaim(t, ns, "c", class.Name, framework.OnNode(nodeA))
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "c", "ProvisioningFailed", "node "+nodeA+" cannot hold the volume", nodeProc)
	if !strings.Contains(ev.Message, "read-only file system") {
		t.Errorf("event %q does not say what failed", ev.Message)
	}
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "c", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		node, ok := c.Annotations["volume.kubernetes.io/selected-node"]
		return !ok, fmt.Errorf("claim still has selected node %q", node)
	})
	must(t, err)
}
