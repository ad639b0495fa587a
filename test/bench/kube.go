package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/dirpv/dirpv/test/framework"
)

const (
	annStorageProv = "volume.kubernetes.io/storage-provisioner"
	// createParallelism is how many creates or deletes the bench has in flight, as a kind e2e
	// suite creating claims would.
	createParallelism = 16
)

var size1Gi = resource.MustParse("1Gi")

// newClaim is a bench claim; node, if set, is where the scheduler would have placed its pod.
func newClaim(ns, name, class, node string) *v1.PersistentVolumeClaim {
	if node == "" {
		return framework.NewClaim(ns, name, class)
	}
	return framework.NewClaim(ns, name, class, framework.OnNode(node))
}

// staticPV is a PV pre-bound to ns/claim (claimRef), of a class without a provisioner: the
// ceiling's volumes. Its source is a CSI source of a driver nobody runs, so it is shaped like a
// dirpv PV and nothing ever tries to mount or delete it.
func staticPV(name, class, ns, claim string, reclaim v1.PersistentVolumeReclaimPolicy) *v1.PersistentVolume {
	fs := v1.PersistentVolumeFilesystem
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeSpec{
			StorageClassName:              class,
			PersistentVolumeReclaimPolicy: reclaim,
			AccessModes:                   []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			VolumeMode:                    &fs,
			Capacity:                      v1.ResourceList{v1.ResourceStorage: size1Gi},
			ClaimRef:                      &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: claim},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver:           "bench.invalid",
				VolumeHandle:     name,
				VolumeAttributes: map[string]string{"backend": "local", "basePath": "/nonexistent", "path": name},
			}},
		},
	}
}

// createClass creates a StorageClass made with framework.NewClass.
func (b *bench) createClass(sc *storagev1.StorageClass) error {
	if _, err := b.client.StorageV1().StorageClasses().Create(b.ctx, sc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create StorageClass %s: %w", sc.Name, err)
	}
	return nil
}

func createNamespace(ctx context.Context, c kubernetes.Interface, name string) error {
	_, err := c.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// parallel runs fn(i) for i in [0,n) with createParallelism in flight and returns the first error.
func parallel(n int, fn func(i int) error) error {
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	next := make(chan int)
	for w := 0; w < createParallelism; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := fn(i); err != nil {
					once.Do(func() { first = err })
				}
			}
		}()
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	return first
}

// claimWatch records, from a watch, when each claim of a namespace was first seen Bound.
type claimWatch struct {
	mu    sync.Mutex
	bound map[string]time.Time
	// handed is when kube-controller-manager handed the claim to an external provisioner
	// (the storage-provisioner annotation).
	handed map[string]time.Time
	// labelled is when dirpv labelled the claim with its node; volume, when a PV for it
	// appeared: with handed and bound, where a single claim's time goes.
	labelled, volume map[string]time.Time
	changed          chan struct{}
	stop             chan struct{}
}

func watchClaims(ctx context.Context, c kubernetes.Interface, ns string) (*claimWatch, error) {
	w := &claimWatch{bound: map[string]time.Time{}, handed: map[string]time.Time{}, labelled: map[string]time.Time{},
		volume: map[string]time.Time{}, changed: make(chan struct{}, 1), stop: make(chan struct{})}
	f := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithNamespace(ns))
	inf := f.Core().V1().PersistentVolumeClaims().Informer()
	pvs := informers.NewSharedInformerFactory(c, 0)
	pvInf := pvs.Core().V1().PersistentVolumes().Informer()
	pvInf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(obj any) {
		if pv, ok := obj.(*v1.PersistentVolume); ok && pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns {
			now := time.Now()
			w.mu.Lock()
			w.volume[pv.Spec.ClaimRef.Name] = now
			w.mu.Unlock()
		}
	}})
	see := func(obj any) {
		pvc, ok := obj.(*v1.PersistentVolumeClaim)
		if !ok {
			return
		}
		now := time.Now()
		w.mu.Lock()
		if _, seen := w.handed[pvc.Name]; !seen && pvc.Annotations[annStorageProv] != "" {
			w.handed[pvc.Name] = now
		}
		if _, seen := w.labelled[pvc.Name]; !seen && pvc.Labels["dirpv.io/node"] != "" {
			w.labelled[pvc.Name] = now
		}
		if pvc.Status.Phase != v1.ClaimBound {
			w.mu.Unlock()
			return
		}
		if _, seen := w.bound[pvc.Name]; !seen {
			w.bound[pvc.Name] = now
		}
		w.mu.Unlock()
		select {
		case w.changed <- struct{}{}:
		default:
		}
	}
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: see, UpdateFunc: func(_, n any) { see(n) }})
	f.Start(w.stop)
	pvs.Start(w.stop)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced, pvInf.HasSynced) {
		close(w.stop)
		return nil, fmt.Errorf("claim watch of %s did not sync", ns)
	}
	return w, nil
}

func (w *claimWatch) Stop() { close(w.stop) }

// spans returns, for a claim created at t0, when it was handed to a provisioner, labelled,
// given a PV and Bound, each relative to t0 (negative if never seen).
func (w *claimWatch) spans(name string, t0 time.Time) [4]time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out [4]time.Duration
	for i, m := range []map[string]time.Time{w.handed, w.labelled, w.volume, w.bound} {
		out[i] = -1
		if t, ok := m[name]; ok {
			out[i] = t.Sub(t0)
		}
	}
	return out
}

func (w *claimWatch) boundAt(name string) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	t, ok := w.bound[name]
	return t, ok
}

func (w *claimWatch) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.bound)
}

// lastBound returns the latest Bound time.
func (w *claimWatch) lastBound() time.Time { return w.last(w.bound) }

// lastHanded returns when the last claim was handed to a provisioner; zero if none was.
func (w *claimWatch) lastHanded() time.Time { return w.last(w.handed) }

// meanHandedToBound is the mean time from hand-over to Bound.
func (w *claimWatch) meanHandedToBound() time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	var sum time.Duration
	n := 0
	for k, h := range w.handed {
		if b, ok := w.bound[k]; ok {
			sum += b.Sub(h)
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return sum / time.Duration(n)
}

func (w *claimWatch) last(m map[string]time.Time) time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	var last time.Time
	for _, t := range m {
		if t.After(last) {
			last = t
		}
	}
	return last
}

// waitFor waits until cond holds, re-checking on every change and every 100 ms; progress
// says how far it got for the timeout message.
func waitFor(ctx context.Context, changed <-chan struct{}, timeout time.Duration, cond func() (bool, string)) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, progress := cond()
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (%s)", ctx.Err(), progress)
		case <-deadline.C:
			return fmt.Errorf("timed out after %s: %s", timeout, progress)
		case <-changed:
		case <-tick.C:
		}
	}
}

func (w *claimWatch) waitBound(ctx context.Context, n int, timeout time.Duration) error {
	return waitFor(ctx, w.changed, timeout, func() (bool, string) {
		got := w.count()
		return got >= n, fmt.Sprintf("%d of %d claims Bound", got, n)
	})
}

func (w *claimWatch) waitOne(ctx context.Context, name string, timeout time.Duration) (time.Time, error) {
	var at time.Time
	err := waitFor(ctx, w.changed, timeout, func() (bool, string) {
		var ok bool
		at, ok = w.boundAt(name)
		return ok, "claim " + name + " not Bound"
	})
	return at, err
}

// pvWatch tracks the PVs of one StorageClass bound to claims of one namespace, and optionally deletes those that are Released:
// an ideal deleter with no storage to clean up, the ceiling of deletion.
type pvWatch struct {
	mu      sync.Mutex
	pvs     map[string]v1.PersistentVolumePhase
	changed chan struct{}
	stop    chan struct{}
}

func watchPVs(ctx context.Context, c kubernetes.Interface, class, ns string, deleteReleased bool) (*pvWatch, error) {
	w := &pvWatch{pvs: map[string]v1.PersistentVolumePhase{}, changed: make(chan struct{}, 1), stop: make(chan struct{})}
	released := make(chan string, 100000)
	f := informers.NewSharedInformerFactory(c, 0)
	inf := f.Core().V1().PersistentVolumes().Informer()
	poke := func() {
		select {
		case w.changed <- struct{}{}:
		default:
		}
	}
	set := func(obj any) {
		pv, ok := obj.(*v1.PersistentVolume)
		if !ok || pv.Spec.StorageClassName != class || pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns {
			return
		}
		w.mu.Lock()
		old, had := w.pvs[pv.Name]
		w.pvs[pv.Name] = pv.Status.Phase
		w.mu.Unlock()
		if deleteReleased && pv.Status.Phase == v1.VolumeReleased && (!had || old != v1.VolumeReleased) {
			released <- pv.Name
		}
		poke()
	}
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    set,
		UpdateFunc: func(_, n any) { set(n) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			if pv, ok := obj.(*v1.PersistentVolume); ok {
				w.mu.Lock()
				delete(w.pvs, pv.Name)
				w.mu.Unlock()
				poke()
			}
		},
	})
	if deleteReleased {
		workers(w.stop, released, func(name string) {
			err := c.CoreV1().PersistentVolumes().Delete(context.Background(), name, metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				fmt.Printf("ideal deleter: delete PV %s: %v\n", name, err)
			}
		})
	}
	f.Start(w.stop)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		close(w.stop)
		return nil, fmt.Errorf("PV watch did not sync")
	}
	return w, nil
}

func (w *pvWatch) Stop() { close(w.stop) }

// count is how many of the PVs are in phase; "": how many there are.
func (w *pvWatch) count(phase v1.PersistentVolumePhase) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, ph := range w.pvs {
		if phase == "" || ph == phase {
			n++
		}
	}
	return n
}

// workers calls fn for each item of todo in createParallelism goroutines until stop closes.
func workers[T any](stop <-chan struct{}, todo <-chan T, fn func(T)) {
	for range createParallelism {
		go func() {
			for {
				select {
				case <-stop:
					return
				case item := <-todo:
					fn(item)
				}
			}
		}()
	}
}

// idealProvisioner is the ceiling of external provisioning: it watches claims of its class
// and, as soon as kube-controller-manager hands one to it (the storage-provisioner
// annotation), creates a pre-bound PV, with no storage work, no rate limit and no events.
type idealProvisioner struct {
	stop chan struct{}
}

func startIdealProvisioner(ctx context.Context, c kubernetes.Interface, provisioner string) (*idealProvisioner, error) {
	p := &idealProvisioner{stop: make(chan struct{})}
	todo := make(chan *v1.PersistentVolumeClaim, 100000)
	var mu sync.Mutex
	done := map[string]bool{}
	f := informers.NewSharedInformerFactory(c, 0)
	inf := f.Core().V1().PersistentVolumeClaims().Informer()
	see := func(obj any) {
		pvc, ok := obj.(*v1.PersistentVolumeClaim)
		if !ok || pvc.Spec.VolumeName != "" || pvc.Annotations[annStorageProv] != provisioner {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		if done[pvc.Namespace+"/"+pvc.Name] {
			return
		}
		done[pvc.Namespace+"/"+pvc.Name] = true
		todo <- pvc
	}
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: see, UpdateFunc: func(_, n any) { see(n) }})
	workers(p.stop, todo, func(pvc *v1.PersistentVolumeClaim) {
		pv := staticPV("pvc-"+string(pvc.UID), *pvc.Spec.StorageClassName, pvc.Namespace, pvc.Name, v1.PersistentVolumeReclaimDelete)
		pv.Spec.ClaimRef.UID = pvc.UID
		pv.Annotations = map[string]string{"pv.kubernetes.io/provisioned-by": provisioner}
		if _, err := c.CoreV1().PersistentVolumes().Create(context.Background(), pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			fmt.Printf("ideal provisioner: create PV for %s: %v\n", pvc.Name, err)
		}
	})
	f.Start(p.stop)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		close(p.stop)
		return nil, fmt.Errorf("ideal provisioner did not sync")
	}
	return p, nil
}

func (p *idealProvisioner) Stop() { close(p.stop) }

// percentile returns the p-th percentile (0..100) of ds by nearest rank.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	return s[min(max(int(p/100*float64(len(s))+0.999999)-1, 0), len(s)-1)]
}
