package benchkit

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

const (
	annStorageProv   = "volume.kubernetes.io/storage-provisioner"
	annProvisionedBy = "pv.kubernetes.io/provisioned-by"
)

// BoundPV is a PV pre-bound to claim c (its class, access modes and size), shaped like a dirpv
// PV but of a CSI driver nobody runs, so that nothing ever mounts or deletes it: the
// ceiling's volumes, and the ideal provisioner's.
func BoundPV(name string, c *v1.PersistentVolumeClaim, reclaim v1.PersistentVolumeReclaimPolicy) *v1.PersistentVolume {
	fs := v1.PersistentVolumeFilesystem
	return &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1.PersistentVolumeSpec{
			StorageClassName:              *c.Spec.StorageClassName,
			PersistentVolumeReclaimPolicy: reclaim,
			AccessModes:                   c.Spec.AccessModes,
			VolumeMode:                    &fs,
			Capacity:                      v1.ResourceList{v1.ResourceStorage: c.Spec.Resources.Requests[v1.ResourceStorage]},
			ClaimRef: &v1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1",
				Namespace: c.Namespace, Name: c.Name, UID: c.UID},
			PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
				Driver:           "bench.invalid",
				VolumeHandle:     name,
				VolumeAttributes: map[string]string{"backend": "local", "basePath": "/nonexistent", "path": name},
			}},
		},
	}
}

// CreateNamespace creates namespace name.
func CreateNamespace(ctx context.Context, c kubernetes.Interface, name string) error {
	_, err := c.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// ClaimWatch records, from a watch, when each claim of a namespace was first seen Bound, and
// the steps before: handed to a provisioner by kube-controller-manager (the
// storage-provisioner annotation), labelled with its node by dirpv, given a PV.
type ClaimWatch struct {
	mu                              sync.Mutex
	handed, labelled, volume, bound map[string]time.Time
	changed                         chan struct{}
	stop                            chan struct{}
}

// WatchClaims watches the claims of ns, and the PVs bound to them, until Stop.
func WatchClaims(ctx context.Context, c kubernetes.Interface, ns string) (*ClaimWatch, error) {
	w := &ClaimWatch{bound: map[string]time.Time{}, handed: map[string]time.Time{}, labelled: map[string]time.Time{},
		volume: map[string]time.Time{}, changed: make(chan struct{}, 1), stop: make(chan struct{})}
	f := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithNamespace(ns))
	inf := f.Core().V1().PersistentVolumeClaims().Informer()
	pvs := informers.NewSharedInformerFactory(c, 0)
	pvInf := pvs.Core().V1().PersistentVolumes().Informer()
	first := func(m map[string]time.Time, name string, now time.Time) {
		if _, seen := m[name]; !seen {
			m[name] = now
		}
	}
	_, _ = pvInf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(obj any) {
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
		if pvc.Annotations[annStorageProv] != "" {
			first(w.handed, pvc.Name, now)
		}
		if pvc.Labels["dirpv.io/node"] != "" {
			first(w.labelled, pvc.Name, now)
		}
		bound := pvc.Status.Phase == v1.ClaimBound
		if bound {
			first(w.bound, pvc.Name, now)
		}
		w.mu.Unlock()
		if bound {
			poke(w.changed)
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: see, UpdateFunc: func(_, n any) { see(n) }})
	f.Start(w.stop)
	pvs.Start(w.stop)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced, pvInf.HasSynced) {
		close(w.stop)
		return nil, fmt.Errorf("claim watch of %s did not sync", ns)
	}
	return w, nil
}

func poke(changed chan struct{}) {
	select {
	case changed <- struct{}{}:
	default:
	}
}

// Stop ends the watch.
func (w *ClaimWatch) Stop() { close(w.stop) }

// Spans returns, for a claim created at t0, when it was handed to a provisioner, labelled,
// given a PV and Bound, each relative to t0 (negative if never seen).
func (w *ClaimWatch) Spans(name string, t0 time.Time) [4]time.Duration {
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

// LastBound returns the latest Bound time.
func (w *ClaimWatch) LastBound() time.Time { return w.last(w.bound) }

// LastHanded returns when the last claim was handed to a provisioner; zero if none was.
func (w *ClaimWatch) LastHanded() time.Time { return w.last(w.handed) }

// MeanHandedToBound is the mean time from hand-over to Bound.
func (w *ClaimWatch) MeanHandedToBound() time.Duration {
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

func (w *ClaimWatch) last(m map[string]time.Time) time.Time {
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

// WaitBound waits until n claims are Bound.
func (w *ClaimWatch) WaitBound(ctx context.Context, n int, timeout time.Duration) error {
	return WaitFor(ctx, w.changed, timeout, func() (bool, string) {
		w.mu.Lock()
		got := len(w.bound)
		w.mu.Unlock()
		return got >= n, fmt.Sprintf("%d of %d claims Bound", got, n)
	})
}

// WaitOne waits until claim name is Bound and returns when it was first seen so.
func (w *ClaimWatch) WaitOne(ctx context.Context, name string, timeout time.Duration) (time.Time, error) {
	var at time.Time
	err := WaitFor(ctx, w.changed, timeout, func() (bool, string) {
		w.mu.Lock()
		defer w.mu.Unlock()
		var ok bool
		at, ok = w.bound[name]
		return ok, "claim " + name + " not Bound"
	})
	return at, err
}

// WaitFor waits until cond holds, re-checking on every change and every 100 ms; progress
// says how far it got for the timeout message.
func WaitFor(ctx context.Context, changed <-chan struct{}, timeout time.Duration, cond func() (bool, string)) error {
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

// Bind creates namespace ns and claim(0..n-1) in it, Parallelism at a time, and waits until
// all are Bound. ready, if set, runs (untimed) once the watch is up, before the first create.
// It returns the time from the first create to the last Bound, and the watch, stopped.
func Bind(ctx context.Context, c kubernetes.Interface, ns string, n int, claim func(i int) *v1.PersistentVolumeClaim, timeout time.Duration, ready func()) (time.Duration, *ClaimWatch, error) {
	if err := CreateNamespace(ctx, c, ns); err != nil {
		return 0, nil, err
	}
	w, err := WatchClaims(ctx, c, ns)
	if err != nil {
		return 0, nil, err
	}
	defer w.Stop()
	if ready != nil {
		ready()
	}
	t0 := time.Now()
	err = Parallel(n, Parallelism, func(i int) error {
		_, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim(i), metav1.CreateOptions{})
		return err
	})
	if err == nil {
		err = w.WaitBound(ctx, n, timeout)
	}
	if err != nil {
		return 0, nil, err
	}
	return w.LastBound().Sub(t0), w, nil
}

// Ceiling binds n claims of ns (claim(i)), of a class without a provisioner, to n PVs made
// up front and pre-bound to them (BoundPV), and returns Bind's time: kube-controller-manager's
// own binding, which no provisioner can beat. It waits until kube-controller-manager has seen
// every PV (Available) first, so that the timed part is the binding alone.
func Ceiling(ctx context.Context, c kubernetes.Interface, ns string, n int, claim func(i int) *v1.PersistentVolumeClaim, timeout time.Duration, ready func()) (time.Duration, error) {
	class := *claim(0).Spec.StorageClassName
	pw, err := WatchPVs(ctx, c, class, ns, false)
	if err != nil {
		return 0, err
	}
	err = Parallel(n, Parallelism, func(i int) error {
		_, err := c.CoreV1().PersistentVolumes().Create(ctx, BoundPV(fmt.Sprintf("ceil-%s-%04d", ns, i), claim(i), v1.PersistentVolumeReclaimRetain), metav1.CreateOptions{})
		return err
	})
	if err == nil {
		err = WaitFor(ctx, pw.changed, timeout, func() (bool, string) {
			avail := pw.Count(v1.VolumeAvailable)
			return avail == n, fmt.Sprintf("%d of %d PVs Available", avail, n)
		})
	}
	pw.Stop()
	if err != nil {
		return 0, err
	}
	d, _, err := Bind(ctx, c, ns, n, claim, timeout, ready)
	return d, err
}

// DeleteAll deletes the claims of ns, Parallelism at a time, and waits until every PV of class
// bound to one of them is gone and done (e.g. the base directory is empty), if set, holds.
// With idealDeleter, the bench deletes each PV the instant it is Released: the ceiling of
// deletion. It returns the time from the first delete.
func DeleteAll(ctx context.Context, c kubernetes.Interface, ns, class string, idealDeleter bool, timeout time.Duration, done func() (bool, string)) (time.Duration, error) {
	pw, err := WatchPVs(ctx, c, class, ns, idealDeleter)
	if err != nil {
		return 0, err
	}
	defer pw.Stop()
	claims, err := c.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, err
	}
	t0 := time.Now()
	err = Parallel(len(claims.Items), Parallelism, func(i int) error {
		return c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, claims.Items[i].Name, metav1.DeleteOptions{})
	})
	if err != nil {
		return 0, err
	}
	err = WaitFor(ctx, pw.changed, timeout, func() (bool, string) {
		if left := pw.Count(""); left > 0 {
			return false, fmt.Sprintf("%d PVs of class %s for claims in %s left", left, class, ns)
		}
		if done != nil {
			return done()
		}
		return true, ""
	})
	return time.Since(t0), err
}

// PVWatch tracks the PVs of one StorageClass bound to claims of one namespace.
type PVWatch struct {
	mu      sync.Mutex
	pvs     map[string]v1.PersistentVolumePhase
	changed chan struct{}
	stop    chan struct{}
}

// WatchPVs watches the PVs of class bound to claims of ns until Stop; with deleteReleased it
// deletes each the instant it is Released.
func WatchPVs(ctx context.Context, c kubernetes.Interface, class, ns string, deleteReleased bool) (*PVWatch, error) {
	w := &PVWatch{pvs: map[string]v1.PersistentVolumePhase{}, changed: make(chan struct{}, 1), stop: make(chan struct{})}
	released := make(chan string, 100000)
	f := informers.NewSharedInformerFactory(c, 0)
	inf := f.Core().V1().PersistentVolumes().Informer()
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
		poke(w.changed)
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
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
				poke(w.changed)
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

// Stop ends the watch.
func (w *PVWatch) Stop() { close(w.stop) }

// Count is how many of the PVs are in phase; "": how many there are.
func (w *PVWatch) Count(phase v1.PersistentVolumePhase) int {
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

// workers calls fn for each item of todo in Parallelism goroutines until stop closes.
func workers[T any](stop <-chan struct{}, todo <-chan T, fn func(T)) {
	for range Parallelism {
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

// StartIdeal starts the ideal external provisioner of provisioner: it watches claims and, as
// soon as kube-controller-manager hands one to it (the storage-provisioner annotation),
// creates a PV pre-bound to it, with no rate limit, no events and no checks: what any external
// provisioner, dirpv included, can at best reach. With dir set it does the storage work too:
// a directory in dir per volume, and for each of its PVs that is Released, the directory
// removed, then the PV deleted. stop ends it and returns the first error it met.
func StartIdeal(ctx context.Context, c kubernetes.Interface, provisioner, dir string) (stop func() error, err error) {
	done := make(chan struct{})
	var (
		mu    sync.Mutex
		seen  = map[string]bool{}
		first error
	)
	once := func(key string) bool {
		mu.Lock()
		defer mu.Unlock()
		ok := !seen[key]
		seen[key] = true
		return ok
	}
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if first == nil {
			first = err
		}
	}
	provision := make(chan *v1.PersistentVolumeClaim, 100000)
	workers(done, provision, func(pvc *v1.PersistentVolumeClaim) {
		pv := BoundPV("pvc-"+string(pvc.UID), pvc, v1.PersistentVolumeReclaimDelete)
		pv.Annotations = map[string]string{annProvisionedBy: provisioner}
		if dir != "" {
			if err := os.Mkdir(filepath.Join(dir, pv.Name), 0o777); err != nil {
				fail(err)
				return
			}
		}
		if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			fail(fmt.Errorf("ideal provisioner: create PV for %s/%s: %w", pvc.Namespace, pvc.Name, err))
		}
	})
	f := informers.NewSharedInformerFactory(c, 0)
	claims := f.Core().V1().PersistentVolumeClaims().Informer()
	onClaim := func(o any) {
		pvc, ok := o.(*v1.PersistentVolumeClaim)
		if ok && pvc.Spec.VolumeName == "" && pvc.Annotations[annStorageProv] == provisioner && once("pvc/"+string(pvc.UID)) {
			provision <- pvc
		}
	}
	_, _ = claims.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onClaim, UpdateFunc: func(_, o any) { onClaim(o) }})
	synced := []cache.InformerSynced{claims.HasSynced}
	if dir != "" {
		release := make(chan string, 100000)
		workers(done, release, func(name string) {
			if err := os.Remove(filepath.Join(dir, name)); err != nil && !os.IsNotExist(err) {
				fail(err)
				return
			}
			if err := c.CoreV1().PersistentVolumes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				fail(fmt.Errorf("ideal deleter: delete PV %s: %w", name, err))
			}
		})
		pvs := f.Core().V1().PersistentVolumes().Informer()
		onPV := func(o any) {
			pv, ok := o.(*v1.PersistentVolume)
			if ok && pv.Status.Phase == v1.VolumeReleased && pv.Annotations[annProvisionedBy] == provisioner && once("pv/"+pv.Name) {
				release <- pv.Name
			}
		}
		_, _ = pvs.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onPV, UpdateFunc: func(_, o any) { onPV(o) }})
		synced = append(synced, pvs.HasSynced)
	}
	f.Start(done)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if !cache.WaitForCacheSync(sctx.Done(), synced...) {
		close(done)
		return nil, fmt.Errorf("ideal provisioner did not sync")
	}
	return func() error {
		close(done)
		mu.Lock()
		defer mu.Unlock()
		return first
	}, nil
}
