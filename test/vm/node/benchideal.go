package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/mount-utils"
)

const (
	annStorageProvisioner = "volume.kubernetes.io/storage-provisioner"
	annProvisionedBy      = "pv.kubernetes.io/provisioned-by"
)

// runIdeal is the guest's side of StartIdeal: it serves until the host writes reqPath.stop,
// having written reqPath.ready once it serves. Like test/bench's ideal external provisioner
// (no rate limit, no events, no checks), plus the storage work: a directory per volume,
// through the kernel NFS client.
func runIdeal(ctx context.Context, mounter mount.Interface, req BenchRequest, target, reqPath string) (err error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", req.Ideal.Kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 5000, 10000
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(target, 0o755); err != nil {
		return err
	}
	if err := mounter.Mount(req.Source, target, "nfs", req.Options); err != nil {
		return err
	}
	defer func() {
		if uerr := mounter.Unmount(target); uerr != nil && err == nil {
			err = uerr
		}
	}()
	var (
		mu    sync.Mutex
		seen  = map[string]bool{}
		first error
	)
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if first == nil {
			first = err
		}
	}
	once := func(key string) bool {
		mu.Lock()
		defer mu.Unlock()
		if seen[key] {
			return false
		}
		seen[key] = true
		return true
	}
	provision := make(chan *corev1.PersistentVolumeClaim, 100000)
	release := make(chan *corev1.PersistentVolume, 100000)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(stop)
	for range max(1, req.Ideal.Parallel) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				case pvc := <-provision:
					if err := idealProvision(ctx, cs, req.Ideal.Provisioner, target, pvc); err != nil {
						fail(err)
					}
				case pv := <-release:
					if err := idealDelete(ctx, cs, target, pv); err != nil {
						fail(err)
					}
				}
			}
		}()
	}
	f := informers.NewSharedInformerFactory(cs, 0)
	claims, pvs := f.Core().V1().PersistentVolumeClaims().Informer(), f.Core().V1().PersistentVolumes().Informer()
	onClaim := func(o any) {
		pvc, ok := o.(*corev1.PersistentVolumeClaim)
		if ok && pvc.Spec.VolumeName == "" && pvc.Annotations[annStorageProvisioner] == req.Ideal.Provisioner && once("pvc/"+string(pvc.UID)) {
			provision <- pvc
		}
	}
	onPV := func(o any) {
		pv, ok := o.(*corev1.PersistentVolume)
		if ok && pv.Status.Phase == corev1.VolumeReleased && pv.Annotations[annProvisionedBy] == req.Ideal.Provisioner && once("pv/"+pv.Name) {
			release <- pv
		}
	}
	_, _ = claims.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onClaim, UpdateFunc: func(_, o any) { onClaim(o) }})
	_, _ = pvs.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onPV, UpdateFunc: func(_, o any) { onPV(o) }})
	f.Start(stop)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if !cache.WaitForCacheSync(sctx.Done(), claims.HasSynced, pvs.HasSynced) {
		return errors.New("ideal provisioner: informers did not sync")
	}
	if err := writeRenamed(reqPath+".ready", nil); err != nil {
		return err
	}
	// The host's stop, or the end of the longest bench run.
	deadline := time.Now().Add(time.Hour)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(reqPath + ".stop"); err == nil {
			mu.Lock()
			err := first
			mu.Unlock()
			return err
		}
		time.Sleep(controlPoll)
	}
	return errors.New("ideal provisioner: the host never asked it to stop")
}

// idealProvision makes the claim's directory on the export and a PV pre-bound to the claim.
func idealProvision(ctx context.Context, cs kubernetes.Interface, provisioner, export string, pvc *corev1.PersistentVolumeClaim) error {
	name := "pvc-" + string(pvc.UID)
	if err := os.Mkdir(filepath.Join(export, name), 0o777); err != nil {
		return err
	}
	fs := corev1.PersistentVolumeFilesystem
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: map[string]string{annProvisionedBy: provisioner}},
		Spec: corev1.PersistentVolumeSpec{
			StorageClassName:              *pvc.Spec.StorageClassName,
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			AccessModes:                   pvc.Spec.AccessModes,
			VolumeMode:                    &fs,
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("16Mi")},
			ClaimRef: &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1",
				Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: "bench.invalid", VolumeHandle: name,
			}},
		},
	}
	if _, err := cs.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("ideal provisioner: create PV for %s/%s: %w", pvc.Namespace, pvc.Name, err)
	}
	return nil
}

// idealDelete removes a Released PV's directory, then the PV.
func idealDelete(ctx context.Context, cs kubernetes.Interface, export string, pv *corev1.PersistentVolume) error {
	if err := os.Remove(filepath.Join(export, pv.Name)); err != nil && !os.IsNotExist(err) {
		return err
	}
	if err := cs.CoreV1().PersistentVolumes().Delete(ctx, pv.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("ideal deleter: delete PV %s: %w", pv.Name, err)
	}
	return nil
}
