package benchkit

import (
	"context"
	"fmt"
	"maps"
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

// Watch follows objects through informers: each one's current state, and when each was
// first seen with each of its marks (a claim's hand-over to a provisioner, its PV, Bound).
type Watch struct {
	mu      sync.Mutex
	state   map[string]string
	first   map[string]map[string]time.Time // mark -> name -> first seen
	changed chan struct{}
	stop    chan struct{}
}

// view is what a Watch sees of an object: its name ("": not watched), its state ("": not
// tracked) and its marks now.
type view func(obj any) (name, state string, marks []string)

// Claims' marks: handed to a provisioner by kube-controller-manager (the
// storage-provisioner annotation), labelled with its node, given a PV, Bound.
const (
	Handed   = "handed"
	Labelled = "labelled"
	Volume   = "volume"
	Bound    = "Bound"
)

// watch starts informers (start), each with its view, and returns once they have synced.
// onFirst, if set, is called when an object is first seen with a mark.
func watch(ctx context.Context, views map[cache.SharedIndexInformer]view, onFirst func(mark, name string), start ...func(stop <-chan struct{})) (*Watch, error) {
	w := &Watch{state: map[string]string{}, first: map[string]map[string]time.Time{}, changed: make(chan struct{}, 1), stop: make(chan struct{})}
	var synced []cache.InformerSynced
	for inf, v := range views {
		set := func(obj any) {
			name, state, marks := v(obj)
			if name == "" {
				return
			}
			now := time.Now()
			w.mu.Lock()
			if state != "" {
				w.state[name] = state
			}
			var fresh []string
			for _, m := range marks {
				if w.first[m] == nil {
					w.first[m] = map[string]time.Time{}
				}
				if _, seen := w.first[m][name]; !seen {
					w.first[m][name] = now
					fresh = append(fresh, m)
				}
			}
			w.mu.Unlock()
			for _, m := range fresh {
				if onFirst != nil {
					onFirst(m, name)
				}
			}
			poke(w.changed)
		}
		_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: set, UpdateFunc: func(_, o any) { set(o) },
			DeleteFunc: func(obj any) {
				if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
					obj = t.Obj
				}
				if name, state, _ := v(obj); name != "" && state != "" {
					w.mu.Lock()
					delete(w.state, name)
					w.mu.Unlock()
					poke(w.changed)
				}
			}})
		synced = append(synced, inf.HasSynced)
	}
	for _, s := range start {
		s(w.stop)
	}
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		close(w.stop)
		return nil, fmt.Errorf("watch did not sync")
	}
	return w, nil
}

func poke(changed chan struct{}) {
	select {
	case changed <- struct{}{}:
	default:
	}
}

// WatchClaims watches the claims of ns, and the PVs bound to them, until Stop: each claim's
// phase, and its marks.
func WatchClaims(ctx context.Context, c kubernetes.Interface, ns string) (*Watch, error) {
	f := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithNamespace(ns))
	pvs := informers.NewSharedInformerFactory(c, 0)
	return watch(ctx, map[cache.SharedIndexInformer]view{
		f.Core().V1().PersistentVolumeClaims().Informer(): func(obj any) (string, string, []string) {
			pvc, ok := obj.(*v1.PersistentVolumeClaim)
			if !ok {
				return "", "", nil
			}
			var marks []string
			if pvc.Annotations[annStorageProv] != "" {
				marks = append(marks, Handed)
			}
			if pvc.Labels["dirpv.io/node"] != "" {
				marks = append(marks, Labelled)
			}
			if pvc.Status.Phase == v1.ClaimBound {
				marks = append(marks, Bound)
			}
			return pvc.Name, string(pvc.Status.Phase), marks
		},
		pvs.Core().V1().PersistentVolumes().Informer(): func(obj any) (string, string, []string) {
			if pv, ok := obj.(*v1.PersistentVolume); ok && pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns {
				return pv.Spec.ClaimRef.Name, "", []string{Volume}
			}
			return "", "", nil
		},
	}, nil, f.Start, pvs.Start)
}

// watchPVs watches the PVs of class bound to claims of ns until Stop: each one's phase. With
// deleteReleased it deletes each the instant it is Released: an ideal deleter.
func watchPVs(ctx context.Context, c kubernetes.Interface, class, ns string, deleteReleased bool) (*Watch, error) {
	f := informers.NewSharedInformerFactory(c, 0)
	released := make(chan string, 100000)
	w, err := watch(ctx, map[cache.SharedIndexInformer]view{f.Core().V1().PersistentVolumes().Informer(): func(obj any) (string, string, []string) {
		pv, ok := obj.(*v1.PersistentVolume)
		if !ok || pv.Spec.StorageClassName != class || pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns {
			return "", "", nil
		}
		return pv.Name, string(pv.Status.Phase), []string{string(pv.Status.Phase)}
	}}, func(phase, name string) {
		if deleteReleased && phase == string(v1.VolumeReleased) {
			released <- name
		}
	}, f.Start)
	if err == nil && deleteReleased {
		workers(w.stop, released, func(name string) {
			err := c.CoreV1().PersistentVolumes().Delete(context.Background(), name, metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				fmt.Printf("ideal deleter: delete PV %s: %v\n", name, err)
			}
		})
	}
	return w, err
}

// Stop ends the watch.
func (w *Watch) Stop() { close(w.stop) }

// Count is how many objects are in state; "": how many there are.
func (w *Watch) Count(state string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, st := range w.state {
		if state == "" || st == state {
			n++
		}
	}
	return n
}

// First returns when each object was first seen with mark.
func (w *Watch) First(mark string) map[string]time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.first[mark])
}

// Last returns when the last object was first seen with mark; zero if none was.
func (w *Watch) Last(mark string) time.Time {
	var last time.Time
	for _, t := range w.First(mark) {
		if t.After(last) {
			last = t
		}
	}
	return last
}

// WaitOne waits until claim name is Bound and returns when it was first seen so.
func (w *Watch) WaitOne(ctx context.Context, name string, timeout time.Duration) (time.Time, error) {
	var at time.Time
	err := w.Wait(ctx, timeout, func() (bool, string) {
		var ok bool
		at, ok = w.First(Bound)[name]
		return ok, "claim " + name + " not Bound"
	})
	return at, err
}

// Wait waits until cond holds, re-checking on every change of the watch and every 100 ms;
// progress says how far it got for the timeout message.
func (w *Watch) Wait(ctx context.Context, timeout time.Duration, cond func() (bool, string)) error {
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
		case <-w.changed:
		case <-tick.C:
		}
	}
}

// Bind creates namespace ns and, with create(0..n-1), n claims in it, Parallelism at a time,
// and waits until all are Bound. ready, if set, runs (untimed) once the watch is up, before the
// first create. It returns the time from the first create to the last Bound, and the watch,
// stopped.
func Bind(ctx context.Context, c kubernetes.Interface, ns string, n int, create func(i int) error, timeout time.Duration, ready func()) (time.Duration, *Watch, error) {
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
	err = Parallel(n, Parallelism, create)
	if err == nil {
		err = w.Wait(ctx, timeout, func() (bool, string) {
			got := len(w.First(Bound))
			return got >= n, fmt.Sprintf("%d of %d claims Bound", got, n)
		})
	}
	if err != nil {
		return 0, nil, err
	}
	return w.Last(Bound).Sub(t0), w, nil
}

// Creator creates claim(i) in ns: Bind's create of claims alone.
func Creator(ctx context.Context, c kubernetes.Interface, claim func(i int) *v1.PersistentVolumeClaim) func(i int) error {
	return func(i int) error {
		pvc := claim(i)
		_, err := c.CoreV1().PersistentVolumeClaims(pvc.Namespace).Create(ctx, pvc, metav1.CreateOptions{})
		return err
	}
}

// Ceiling binds n claims of ns (claim(i)), of a class without a provisioner, to n PVs made
// up front and pre-bound to them (BoundPV), and returns Bind's time: kube-controller-manager's
// own binding, which no provisioner can beat. It waits until kube-controller-manager has seen
// every PV (Available) first, so that the timed part is the binding alone.
func Ceiling(ctx context.Context, c kubernetes.Interface, ns string, n int, claim func(i int) *v1.PersistentVolumeClaim, timeout time.Duration, ready func()) (time.Duration, error) {
	pw, err := watchPVs(ctx, c, *claim(0).Spec.StorageClassName, ns, false)
	if err != nil {
		return 0, err
	}
	err = Parallel(n, Parallelism, func(i int) error {
		_, err := c.CoreV1().PersistentVolumes().Create(ctx, BoundPV(fmt.Sprintf("ceil-%s-%04d", ns, i), claim(i), v1.PersistentVolumeReclaimRetain), metav1.CreateOptions{})
		return err
	})
	if err == nil {
		err = pw.Wait(ctx, timeout, func() (bool, string) {
			avail := pw.Count(string(v1.VolumeAvailable))
			return avail == n, fmt.Sprintf("%d of %d PVs Available", avail, n)
		})
	}
	pw.Stop()
	if err != nil {
		return 0, err
	}
	d, _, err := Bind(ctx, c, ns, n, Creator(ctx, c, claim), timeout, ready)
	return d, err
}

// DeleteAll deletes the claims of ns, Parallelism at a time, and waits until every PV of class
// bound to one of them is gone and done (e.g. the base directory is empty), if set, holds.
// With idealDeleter, the bench deletes each PV the instant it is Released: the ceiling of
// deletion. It returns the time from the first delete.
func DeleteAll(ctx context.Context, c kubernetes.Interface, ns, class string, idealDeleter bool, timeout time.Duration, done func() (bool, string)) (time.Duration, error) {
	pw, err := watchPVs(ctx, c, class, ns, idealDeleter)
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
	err = pw.Wait(ctx, timeout, func() (bool, string) {
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
