package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/framework"
)

// The provisioners the suite's controller and node-a adopt (--adopt-provisioners): nfs-subdir
// under its chart's default name, local-path under a name of its own (its --provisioner-name),
// since TestOtherProvisionersObjectsUntouched plays kind's rancher.io/local-path still running.
const (
	nfsSubdir = "cluster.local/nfs-subdir-external-provisioner"
	localPath = "example.com/local-path"
)

// adoptWait bounds a wait for the lib's retry of a Delete that failed before the class was
// replaced: its back-off starts at 15 s and doubles.
const adoptWait = 3 * time.Minute

// boundToAdopted creates claim name of class and the PV that provisioner by made for it, as
// that provisioner makes them (named pvc-<claim UID>, annotated with its name, reclaim
// Delete, the claim's access modes and size), with src(the PV's name) and affinity, and waits
// until kube-controller-manager binds them.
func boundToAdopted(t *testing.T, ns, name, class, by string, src func(pv string) v1.PersistentVolumeSource, affinity *v1.VolumeNodeAffinity, mountOptions ...string) *v1.PersistentVolume {
	t.Helper()
	ctx := context.Background()
	claim := suite.CreateClaim(t, ns, name, class, framework.AccessModes(v1.ReadWriteMany))
	pvName := "pvc-" + string(claim.UID)
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName, Annotations: map[string]string{provisioner.AnnProvisionedBy: by}},
		Spec: v1.PersistentVolumeSpec{
			Capacity:                      v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   claim.Spec.AccessModes,
			PersistentVolumeReclaimPolicy: v1.PersistentVolumeReclaimDelete,
			StorageClassName:              class,
			MountOptions:                  mountOptions,
			VolumeMode:                    ptr.To(v1.PersistentVolumeFilesystem),
			PersistentVolumeSource:        src(pvName),
			NodeAffinity:                  affinity,
			ClaimRef:                      &v1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: name, UID: claim.UID},
		},
	}
	pv, err := suite.Client.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		// A PV dirpv refused to delete keeps the lib's finalizer: take it off, or it stays.
		ctx := context.Background()
		suite.Client.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
		suite.Client.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{})
	})
	_, err = framework.WaitForPVCBound(ctx, suite.Client, ns, name, timeout)
	must(t, err)
	return pv
}

// mkdirWithFile makes dir as the adopted provisioners do (0777) with a file the test checks.
func mkdirWithFile(t *testing.T, dir string) {
	t.Helper()
	must(t, os.MkdirAll(dir, 0o777))
	must(t, os.WriteFile(filepath.Join(dir, "data"), []byte("old"), 0o644))
}

// waitDeleteRefused waits for the lib's VolumeFailedDelete event on the PV saying why, and
// checks that the PV is still there.
func waitDeleteRefused(t *testing.T, pv, why string) {
	t.Helper()
	ctx := context.Background()
	_, err := framework.WaitForEvent(ctx, suite.Client, "", "PersistentVolume", pv, "VolumeFailedDelete", why, adoptWait)
	must(t, err, ctrlProc)
	if _, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv, metav1.GetOptions{}); err != nil {
		t.Errorf("PV %s after dirpv refused to delete it: %v, want it kept", pv, err)
	}
}

// replaceClass replaces the class name, still the old provisioner's, by the dirpv class that
// `dirpv convert-class` with flags makes of it (framework.ReplaceClass).
func replaceClass(t *testing.T, name string, flags ...string) *storagev1.StorageClass {
	t.Helper()
	c, err := framework.ReplaceClass(context.Background(), suite.Client, suite.Dirpv, name, flags...)
	must(t, err)
	return c
}

// Moving from nfs-subdir-external-provisioner without copying data: its PVs (in-tree nfs, the
// directory <namespace>-<claim>-<PV> on its export) are dirpv's to reclaim once dirpv adopts
// its name. While the class is still nfs-subdir's, a released PV is kept, with an event that
// says why. Once a dirpv class of the same name replaces it (archiveOnDelete "true" becomes
// onDelete archive, its naming a pathPattern), the released PV's directory is archived on the
// export with its data and the PV goes; a new claim of the same class name gets a dirpv volume
// on the same export. A PV whose directory is not inside the class's share is never touched.
func TestTakeOverFromNFSSubdir(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	srv := suite.NFS
	class := className(t)
	suite.CreateClass(t, class, map[string]string{"archiveOnDelete": "true"}, framework.Provisioner(nfsSubdir),
		framework.Immediate, framework.MountOptions("nolock", "nfsvers=3"))
	// nfs-subdir's directory: <namespace>-<claim>-<PV>, made 0777 on its export.
	dirOf := func(claim string) func(pv string) v1.PersistentVolumeSource {
		return func(pv string) v1.PersistentVolumeSource {
			return v1.PersistentVolumeSource{NFS: &v1.NFSVolumeSource{Server: srv.Addr, Path: srv.Share + "/" + ns + "-" + claim + "-" + pv}}
		}
	}
	old := boundToAdopted(t, ns, "old", class, nfsSubdir, dirOf("old"), nil, "nolock", "nfsvers=3")
	dir := ns + "-old-" + old.Name
	mkdirWithFile(t, filepath.Join(srv.ExportDir, dir))
	outside := boundToAdopted(t, ns, "outside", class, nfsSubdir, func(string) v1.PersistentVolumeSource {
		return v1.PersistentVolumeSource{NFS: &v1.NFSVolumeSource{Server: srv.Addr, Path: "/elsewhere/" + ns}}
	}, nil, "nolock", "nfsvers=3")

	deleteClaim(t, ns, "old")
	waitDeleteRefused(t, old.Name, "is still "+nfsSubdir+"'s")
	if b, err := os.ReadFile(filepath.Join(srv.ExportDir, dir, "data")); err != nil || string(b) != "old" {
		t.Errorf("the directory of a PV whose class is still nfs-subdir's: %q, %v; want it untouched", b, err)
	}

	if c := replaceClass(t, class, "--nfs-server="+srv.Addr, "--nfs-share="+srv.Share); c.Parameters["onDelete"] != "archive" {
		t.Errorf("the class that replaced nfs-subdir's (archiveOnDelete true) has onDelete %q, want archive", c.Parameters["onDelete"])
	}
	must(t, framework.WaitForPVDeleted(ctx, suite.Client, old.Name, adoptWait), ctrlProc)
	var archived []string
	for _, n := range entries(t, srv.ExportDir) {
		if strings.HasPrefix(n, "archived-"+dir+"-") {
			archived = append(archived, n)
		}
		if n == dir {
			t.Errorf("%s still on the export after its archive", dir)
		}
	}
	if len(archived) != 1 {
		t.Fatalf("archives of %s on the export: %v, want one", dir, archived)
	}
	if b, err := os.ReadFile(filepath.Join(srv.ExportDir, archived[0], "data")); err != nil || string(b) != "old" {
		t.Errorf("archived data: %q, %v", b, err)
	}

	suite.CreateClaim(t, ns, "new", class, framework.AccessModes(v1.ReadWriteMany))
	_, pv := waitBound(t, ns, "new")
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != "dirpv.io" {
		t.Fatalf("the new claim of class %s got PV %+v, want a dirpv.io volume", class, pv.Spec.PersistentVolumeSource)
	}
	if st, err := os.Stat(filepath.Join(srv.ExportDir, ns+"-new-"+pv.Name)); err != nil || !st.IsDir() {
		t.Errorf("the new claim's directory on the export: %v", err)
	}

	before := entries(t, srv.ExportDir)
	deleteClaim(t, ns, "outside")
	waitDeleteRefused(t, outside.Name, "is not inside")
	if after := entries(t, srv.ExportDir); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("the export changed when a PV outside its share was refused: %v, was %v", after, before)
	}
}

// Moving from local-path-provisioner: its hostPath PVs (the directory <PV>_<namespace>_<claim>
// under its base, node affinity on the node's hostname) are handed to their node's dirpv (the
// controller gives them dirpv's node annotation and label), which refuses to delete them while
// the class is still local-path's and deletes them, once a dirpv class replaced local-path's
// under the same name, as it says. A PV whose directory is outside the class's base path is
// never touched. (A new claim of the class name getting a dirpv volume in the same base, with
// pods, is test/e2e/install's TestTakeOverFromRunningLocalPath.)
func TestTakeOverFromLocalPath(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	class := className(t)
	base := filepath.Join(suite.Work.BaseRoot, class)
	suite.CreateClass(t, class, nil, framework.Provisioner(localPath))
	onNodeA := &v1.VolumeNodeAffinity{Required: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{
		MatchExpressions: []v1.NodeSelectorRequirement{{Key: v1.LabelHostname, Operator: v1.NodeSelectorOpIn, Values: []string{"host-" + nodeA}}},
	}}}}
	// local-path's directory: <PV>_<namespace>_<claim> under its base, made 0777 by a helper pod.
	dirOf := func(claim string) func(pv string) v1.PersistentVolumeSource {
		return func(pv string) v1.PersistentVolumeSource {
			return v1.PersistentVolumeSource{HostPath: &v1.HostPathVolumeSource{
				Path: filepath.Join(base, pv+"_"+ns+"_"+claim), Type: ptr.To(v1.HostPathDirectoryOrCreate)}}
		}
	}
	old := boundToAdopted(t, ns, "old", class, localPath, dirOf("old"), onNodeA)
	dir := old.Spec.HostPath.Path
	mkdirWithFile(t, dir)
	outside := boundToAdopted(t, ns, "outside", class, localPath, func(pv string) v1.PersistentVolumeSource {
		return v1.PersistentVolumeSource{HostPath: &v1.HostPathVolumeSource{Path: filepath.Join(suite.Work.BaseRoot, pv)}}
	}, onNodeA)
	mkdirWithFile(t, outside.Spec.HostPath.Path)

	// The controller hands both to node-a: the node's instance sees only PVs labelled for it.
	for _, pv := range []string{old.Name, outside.Name} {
		err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
			got, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			return got.Annotations[provisioner.AnnNode] == nodeA && got.Labels[provisioner.LabelNode] == nodeA,
				fmt.Errorf("PV %s has annotations %v, labels %v", pv, got.Annotations, got.Labels)
		})
		must(t, err, ctrlProc)
	}

	deleteClaim(t, ns, "old")
	waitDeleteRefused(t, old.Name, "is still "+localPath+"'s")
	if b, err := os.ReadFile(filepath.Join(dir, "data")); err != nil || string(b) != "old" {
		t.Errorf("the directory of a PV whose class is still local-path's: %q, %v; want it untouched", b, err)
	}

	replaceClass(t, class, "--base-path="+base)
	must(t, framework.WaitForPVDeleted(ctx, suite.Client, old.Name, adoptWait), nodeProc)
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("%s after its PV's delete (onDelete delete): %v, want it gone", dir, err)
	}

	deleteClaim(t, ns, "outside")
	waitDeleteRefused(t, outside.Name, "is not inside")
	if b, err := os.ReadFile(filepath.Join(outside.Spec.HostPath.Path, "data")); err != nil || string(b) != "old" {
		t.Errorf("the directory of a PV outside the class's base after dirpv refused it: %q, %v; want it untouched", b, err)
	}
}
