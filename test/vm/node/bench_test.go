package node_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/node"
	"github.com/dirpv/dirpv/volume"
)

// The NFS phase of make bench (test/bench) runs here, where the guest node is: dirpv installed
// from deploy/, its controller and node plugin in the guest, the export on the guest's kernel
// NFS server, reached through the guest's kernel NFS client. BenchEnv names the JSON file the
// rows go to (test/bench reads it); without it TestBenchNFS does not run, so that make test
// pays nothing for it.
const (
	benchEnv        = "DIRPV_BENCH_NFS"
	benchNEnv       = "DIRPV_BENCH_N"
	benchPublishEnv = "DIRPV_BENCH_PUBLISH_N"
	// benchParallel is how many creates or deletes the bench has in flight (test/bench's
	// createParallelism) and how many directories the floor makes at a time (dirpv's
	// --worker-threads default).
	benchParallel = 16
)

// benchKCMArgs are test/bench's default kube-controller-manager client limits ("-kcm fast"):
// with its defaults (20/30) it binds ~5 claims/s and hides any provisioner's own cost.
var benchKCMArgs = []string{"--kube-api-qps=200", "--kube-api-burst=400"}

// benchRow is a row of test/bench's report (its Row, same JSON).
type benchRow struct {
	Name     string  `json:"name"`
	Value    float64 `json:"value"`
	Unit     string  `json:"unit"`
	Ref      string  `json:"ref,omitempty"`
	RefValue float64 `json:"refValue,omitempty"`
	Ratio    float64 `json:"ratio,omitempty"`
	Note     string  `json:"note,omitempty"`
}

// benchReport is what TestBenchNFS writes: its rows, and its figures by name for test/bench's
// goals.
type benchReport struct {
	N        int                `json:"n"`
	PublishN int                `json:"publishN"`
	Seconds  float64            `json:"seconds"`
	Rows     []benchRow         `json:"rows"`
	Figures  map[string]float64 `json:"figures"`
}

// TestBenchNFS measures, through the guest's kernel NFS client and server, what make bench's
// NFS rows say: N claims of an NFS class create->all Bound, their deletion until PVs and
// directories are gone, and NodePublish+NodeUnpublish of an NFS volume. Each row has its
// references measured in the same run: the binding ceiling of this cluster (N pre-made PVs,
// an ideal deleter), and in the guest, through the same export and mount options, an ideal
// external provisioner and deleter (as test/bench's for local claims, plus the directory),
// the storage floor (mkdir and rmdir of N directories, 16 at a time) and a bare
// mount+umount. dirpv runs in the guest under emulation, so its figures compare with those
// of the guest, not with the host's.
func TestBenchNFS(t *testing.T) {
	out := os.Getenv(benchEnv)
	if out == "" {
		t.Skipf("%s is not set: make bench runs this (test/bench's NFS phase), make test does not", benchEnv)
	}
	n, pubN := envInt(t, benchNEnv, 500), envInt(t, benchPublishEnv, 100)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	b := &nfsBench{ctx: ctx, t: t, report: benchReport{N: n, PublishN: pubN, Figures: map[string]float64{}}}
	cfg, err := clientcmd.BuildConfigFromFlags("", suite.Cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	// The bench's own client must never be what limits a run.
	cfg.QPS, cfg.Burst = 5000, 10000
	if b.cs, err = kubernetes.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}
	// The install waited for the node plugin only: a controller still starting under emulation
	// would count its start in the first timed run.
	if err := framework.Poll(ctx, 5*time.Minute, func(context.Context) (bool, error) {
		m := b.controllerMetrics()
		return m.err == nil, m.err
	}); err != nil {
		t.Fatalf("dirpv's controller in the guest does not serve its metrics: %v", err)
	}
	share, options := "/", []string{"nfsvers=4.2", "hard"}
	floor := node.BenchRequest{Source: node.NFSAddr + ":" + share, Options: options}

	// Binding and deletion: the ceiling, the storage floor, dirpv.
	b.ceiling(n)
	req := floor
	req.Dirs, req.Parallel = n, benchParallel
	res, err := guestNode.Bench(ctx, 10*time.Minute, req)
	if err != nil {
		t.Fatal(err)
	}
	b.figure("floor.mkdir", res.Mkdir.Seconds())
	b.figure("floor.rmdir", res.Rmdir.Seconds())
	b.ideal(n, floor)
	class := suite.CreateClass(t, "bench-nfs", map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": share},
		framework.Immediate, framework.MountOptions(options...))
	m0 := b.controllerMetrics()
	bulk := b.bind("nfs-bulk", class.Name, n)
	b.figure("nfs.bulk", bulk.Seconds())
	bulkNote := m0.since(b.controllerMetrics(), bulk)
	fig := b.report.Figures
	b.add(benchRow{Name: fmt.Sprintf("ceiling (VM node's cluster): %d pre-made PVs, all Bound", n), Value: fig["ceil.bulk"], Unit: "s"})
	b.add(benchRow{Name: fmt.Sprintf("floor: mkdir %d dirs, kernel NFS client (VM)", n), Value: res.Mkdir.Seconds(), Unit: "s",
		Note: fmt.Sprintf("%d at a time, through a mount of %s with %v", benchParallel, floor.Source, options)})
	b.add(benchRow{Name: fmt.Sprintf("ideal external NFS provisioner in the VM: %d claims", n), Value: fig["ideal.bulk"], Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.bulk"], Note: "a directory through the kernel client and a PV per claim, in the guest"})
	b.add(benchRow{Name: fmt.Sprintf("dirpv nfs (kernel, VM): %d claims create->all Bound", n), Value: bulk.Seconds(), Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.bulk"],
		Note: fmt.Sprintf("%.2fx the ideal external provisioner in the guest; %.1fx the mkdir floor; %s", bulk.Seconds()/fig["ideal.bulk"], bulk.Seconds()/res.Mkdir.Seconds(), bulkNote)})
	b.t.Logf("(%.2fx the ideal external NFS provisioner in the guest; %s)", bulk.Seconds()/fig["ideal.bulk"], bulkNote)
	m0 = b.controllerMetrics()
	del := b.deleteNFS("nfs-bulk", class.Name)
	delNote := m0.since(b.controllerMetrics(), del)
	b.figure("nfs.delete", del.Seconds())
	b.add(benchRow{Name: fmt.Sprintf("ceiling (VM node's cluster): delete %d, ideal deleter", n), Value: fig["ceil.delete"], Unit: "s"})
	b.add(benchRow{Name: fmt.Sprintf("floor: rmdir %d dirs, kernel NFS client (VM)", n), Value: res.Rmdir.Seconds(), Unit: "s"})
	b.add(benchRow{Name: fmt.Sprintf("ideal NFS deleter in the VM: delete %d", n), Value: fig["ideal.delete"], Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.delete"], Note: "rmdir through the kernel client, then the PV, in the guest"})
	b.add(benchRow{Name: fmt.Sprintf("dirpv nfs (kernel, VM): delete %d, PVs+dirs gone", n), Value: del.Seconds(), Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.delete"],
		Note: fmt.Sprintf("%.2fx the ideal deleter in the guest; %.1fx the rmdir floor; %s", del.Seconds()/fig["ideal.delete"], del.Seconds()/res.Rmdir.Seconds(), delNote)})
	b.t.Logf("(%.2fx the ideal NFS deleter in the guest; %s)", del.Seconds()/fig["ideal.delete"], delNote)

	// NodePublish of one of the class's volumes, against a bare mount of the same export.
	b.bind("nfs-publish", class.Name, 1)
	pv, err := framework.WaitForBoundPV(ctx, b.cs, "nfs-publish", "c-0000", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	req = floor
	req.Source = node.NFSAddr + ":" + path.Join(share, pv.Spec.CSI.VolumeAttributes["path"])
	req.Publish, req.Rounds, req.VolumeID, req.Attrs = pubN, 5, pv.Spec.CSI.VolumeHandle, pv.Spec.CSI.VolumeAttributes
	req.PodUID = b.runningPodUID()
	if res, err = guestNode.Bench(ctx, 20*time.Minute, req); err != nil {
		t.Fatal(err)
	}
	for _, q := range []float64{50, 95} {
		p := fmt.Sprintf("p%.0f", q)
		m, pub := msOf(percentile(res.Mount, q)), msOf(percentile(res.Publish, q))
		b.figure("nfs.mu."+p, m)
		b.figure("nfs.pub."+p, pub)
		b.add(benchRow{Name: "bare NFS mount+umount, mount-utils (VM) " + p, Value: m, Unit: "ms"})
		b.add(benchRow{Name: "dirpv NFS NodePublish+NodeUnpublish (VM) " + p, Value: pub, Unit: "ms",
			Ref: "mount-utils NFS mount", RefValue: m})
	}

	// A restarted dirpv process would have counted its start in a figure.
	pods, err := b.cs.CoreV1().Pods("dirpv").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		for _, c := range p.Status.ContainerStatuses {
			if c.RestartCount > 0 {
				prev, err := b.cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: c.Name, Previous: true, TailLines: ptr.To[int64](15)}).DoRaw(ctx)
				if err != nil {
					prev = []byte(err.Error())
				}
				t.Errorf("pod %s container %s restarted %d times during the bench: its figures include a start; last state %+v; the end of its previous log:\n%s",
					p.Name, c.Name, c.RestartCount, c.LastTerminationState, prev)
			}
		}
	}
	b.report.Seconds = time.Since(start).Seconds()
	j, err := json.MarshalIndent(b.report, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, append(j, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("NFS bench through the guest's kernel: %s; rows in %s", time.Since(start).Round(time.Second), out)
}

type nfsBench struct {
	ctx    context.Context
	t      *testing.T
	cs     kubernetes.Interface
	report benchReport
}

func (b *nfsBench) figure(name string, v float64) { b.report.Figures[name] = v }

func (b *nfsBench) add(r benchRow) {
	if r.RefValue > 0 {
		r.Ratio = r.Value / r.RefValue
	}
	b.report.Rows = append(b.report.Rows, r)
	ratio := ""
	if r.Ratio > 0 {
		ratio = fmt.Sprintf("  (%.2fx %s)", r.Ratio, r.Ref)
	}
	b.t.Logf("%-52s %10.2f %-5s%s", r.Name, r.Value, r.Unit, ratio)
}

// ceiling binds n claims to n pre-made PVs of a class without a provisioner, then deletes the
// claims with an ideal deleter (each PV deleted the instant it is Released): what
// kube-controller-manager alone takes on this cluster.
func (b *nfsBench) ceiling(n int) {
	class := suite.CreateClass(b.t, "bench-static", nil, framework.Provisioner("kubernetes.io/no-provisioner"), framework.Immediate)
	const ns = "ceil-bulk"
	pvs := b.watchPVs(class.Name)
	defer pvs.stop()
	err := node.Parallel(n, benchParallel, func(i int) error {
		_, err := b.cs.CoreV1().PersistentVolumes().Create(b.ctx, staticPV(fmt.Sprintf("ceil-%04d", i), class.Name, ns, claimName(i)), metav1.CreateOptions{})
		return err
	})
	if err == nil {
		err = pvs.wait(b.ctx, func() (bool, string) {
			a := pvs.count(string(corev1.VolumeAvailable))
			return a == n, fmt.Sprintf("%d of %d PVs Available", a, n)
		})
	}
	if err != nil {
		b.t.Fatal(err)
	}
	b.figure("ceil.bulk", b.bind(ns, class.Name, n).Seconds())
	pvs.deleteReleased(b.cs)
	b.figure("ceil.delete", b.deleteClaims(ns, pvs, nil).Seconds())
}

// The controller's figures that say where its time goes: its CPU, the provisioning
// library's operation (event, dirpv's Provision, PV create) and dirpv's Provision alone.
const (
	metricCPU       = "process_cpu_seconds_total"
	metricLibOp     = "dirpv_persistentvolumeclaim_provision_duration_seconds"
	metricProvision = "dirpv_provision_duration_seconds"
)

// controllerSample is a scrape of dirpv's controller in the guest, summed by metric name
// over its labels; err says why there is none.
type controllerSample struct {
	m   map[string]float64
	err error
}

// controllerMetrics scrapes dirpv's controller, which runs on the guest's host network
// (deploy/'s --http-address=:9809).
func (b *nfsBench) controllerMetrics() controllerSample {
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+node.GuestAddr+":9809/metrics", nil)
	if err != nil {
		return controllerSample{err: err}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return controllerSample{err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return controllerSample{err: err}
	}
	m := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || strings.HasPrefix(line, "#") {
			continue
		}
		name, _, _ := strings.Cut(f[0], "{")
		if v, err := strconv.ParseFloat(f[1], 64); err == nil {
			m[name] += v
		}
	}
	return controllerSample{m: m}
}

// since says what the controller did between s and later, a span of d: its CPU, and the mean
// library operation and dirpv Provision of the claims provisioned meanwhile.
func (s controllerSample) since(later controllerSample, d time.Duration) string {
	if err := errors.Join(s.err, later.err); err != nil {
		return fmt.Sprintf("controller metrics: %v", err)
	}
	delta := func(name string) float64 { return later.m[name] - s.m[name] }
	out := fmt.Sprintf("controller CPU %.1f s (%.0f%% of one CPU)", delta(metricCPU), 100*delta(metricCPU)/d.Seconds())
	if c := delta(metricLibOp + "_count"); c > 0 {
		out += fmt.Sprintf(", mean library op %.0f ms", 1000*delta(metricLibOp+"_sum")/c)
	}
	if c := delta(metricProvision + "_count"); c > 0 {
		out += fmt.Sprintf(", of it dirpv's Provision %.0f ms", 1000*delta(metricProvision+"_sum")/c)
	}
	return out
}

// idealProvisioner is the provisioner name of the ideal external NFS provisioner's class.
const idealProvisioner = "bench.invalid/ideal-nfs"

// ideal binds and deletes n claims through the ideal external NFS provisioner in the guest
// (node.StartIdeal): what any external provisioner on this export reaches at best under the
// guest's emulation, the same ideal that test/bench measures for local claims, plus the
// directory through the kernel client.
func (b *nfsBench) ideal(n int, floor node.BenchRequest) {
	class := suite.CreateClass(b.t, "bench-ideal-nfs", nil, framework.Provisioner(idealProvisioner), framework.Immediate)
	req := floor
	req.Ideal = &node.BenchIdeal{Provisioner: idealProvisioner, Parallel: benchParallel}
	stop, err := guestNode.StartIdeal(b.ctx, req, suite.Cluster.Kubeconfig)
	if err != nil {
		b.t.Fatal(err)
	}
	b.figure("ideal.bulk", b.bind("ideal-bulk", class.Name, n).Seconds())
	pvs := b.watchPVs(class.Name)
	b.figure("ideal.delete", b.deleteClaims("ideal-bulk", pvs, nil).Seconds())
	pvs.stop()
	if err := stop(); err != nil {
		b.t.Fatal(err)
	}
}

// bind creates n claims of class in a new namespace ns, benchParallel at a time, and returns
// the time from the first create to the last Bound.
func (b *nfsBench) bind(ns, class string, n int) time.Duration {
	b.t.Helper()
	if _, err := b.cs.CoreV1().Namespaces().Create(b.ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		b.t.Fatal(err)
	}
	w := newWatch(b.cs, ns, func(f informers.SharedInformerFactory) cache.SharedIndexInformer {
		return f.Core().V1().PersistentVolumeClaims().Informer()
	}, func(o any) (string, string) {
		c := o.(*corev1.PersistentVolumeClaim)
		return c.Name, string(c.Status.Phase)
	})
	defer w.stop()
	t0 := time.Now()
	err := node.Parallel(n, benchParallel, func(i int) error {
		c := framework.NewClaim(ns, claimName(i), class, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
		_, err := b.cs.CoreV1().PersistentVolumeClaims(ns).Create(b.ctx, c, metav1.CreateOptions{})
		return err
	})
	if err == nil {
		err = w.wait(b.ctx, func() (bool, string) {
			bound := w.count(string(corev1.ClaimBound))
			return bound == n, fmt.Sprintf("%d of %d claims of %s Bound", bound, n, class)
		})
	}
	if err != nil {
		b.t.Fatalf("%v\nevents:%s", err, framework.EventsOf(b.ctx, b.cs, ns, "PersistentVolumeClaim", claimName(0)))
	}
	return w.last(string(corev1.ClaimBound)).Sub(t0)
}

// deleteClaims deletes every claim of ns, benchParallel at a time, and returns the time from
// the first delete until pvs holds none of the namespace's volumes and done (if set) holds.
func (b *nfsBench) deleteClaims(ns string, pvs *objWatch, done func() (bool, string)) time.Duration {
	b.t.Helper()
	claims, err := b.cs.CoreV1().PersistentVolumeClaims(ns).List(b.ctx, metav1.ListOptions{})
	if err != nil {
		b.t.Fatal(err)
	}
	t0 := time.Now()
	err = node.Parallel(len(claims.Items), benchParallel, func(i int) error {
		return b.cs.CoreV1().PersistentVolumeClaims(ns).Delete(b.ctx, claims.Items[i].Name, metav1.DeleteOptions{})
	})
	if err == nil {
		err = pvs.wait(b.ctx, func() (bool, string) {
			left := pvs.count("")
			return left == 0, fmt.Sprintf("%d PVs left", left)
		})
	}
	if err == nil && done != nil {
		err = framework.Poll(b.ctx, 10*time.Minute, func(context.Context) (bool, error) {
			ok, why := done()
			return ok, fmt.Errorf("%s", why)
		})
	}
	if err != nil {
		b.t.Fatal(err)
	}
	return time.Since(t0)
}

// deleteNFS deletes the claims of ns, of NFS class class, and returns the time until their
// PVs are gone and the export holds none of their directories, in the trash (from which
// dirpv removes them in the background) or out of it.
func (b *nfsBench) deleteNFS(ns, class string) time.Duration {
	b.t.Helper()
	pvs := b.watchPVs(class)
	defer pvs.stop()
	trash := volume.ReservedPrefix + "trash"
	list := fmt.Sprintf("cd %s && ls -A && echo -- && { ls -A %s 2>/dev/null || true; }", node.NFSExportDir, trash)
	return b.deleteClaims(ns, pvs, func() (bool, string) {
		out, err := guestNode.Exec(b.ctx, time.Minute, "sh", "-c", list)
		if err != nil {
			return false, err.Error()
		}
		exported, trashed, _ := strings.Cut(out, "--\n")
		var left []string
		for _, e := range strings.Fields(exported) {
			// dirpv's own files (the base's identity, the trash) stay.
			if !strings.HasPrefix(e, volume.ReservedPrefix) {
				left = append(left, e)
			}
		}
		inTrash := len(strings.Fields(trashed))
		return len(left)+inTrash == 0, fmt.Sprintf("%d directories left in the export (%v), %d in its trash", len(left), left[:min(len(left), 5)], inTrash)
	})
}

// runningPodUID is the UID of one of dirpv's own pods on the guest node: the publish bench's
// targets go in that pod's directory, which kubelet leaves alone while the pod runs (it removes
// what it finds in its pods directory for no pod).
func (b *nfsBench) runningPodUID() string {
	pods, err := b.cs.CoreV1().Pods("dirpv").List(b.ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + guestNode.Name})
	if err != nil {
		b.t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodRunning {
			return string(p.UID)
		}
	}
	b.t.Fatalf("no running pod of dirpv on node %s among %d", guestNode.Name, len(pods.Items))
	return ""
}

func claimName(i int) string { return fmt.Sprintf("c-%04d", i) }

// staticPV is a PV pre-bound to ns/claim, of a class without a provisioner: the ceiling's
// volumes, shaped like dirpv's, of a driver nobody runs, so that nothing mounts or deletes it.
func staticPV(name, class, ns, claim string) *corev1.PersistentVolume {
	fs := corev1.PersistentVolumeFilesystem
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			StorageClassName:              class,
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			VolumeMode:                    &fs,
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("16Mi")},
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1", Namespace: ns, Name: claim},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: "bench.invalid", VolumeHandle: name,
			}},
		},
	}
}

// objWatch follows the phase of objects through an informer and when each first reached
// each phase.
type objWatch struct {
	mu      sync.Mutex
	phase   map[string]string
	reached map[string]map[string]time.Time // phase -> name -> first seen
	changed chan struct{}
	done    chan struct{}
	// onChange, if set, sees each object as it changes.
	onChange func(o any)
}

func newWatch(cs kubernetes.Interface, ns string, informer func(informers.SharedInformerFactory) cache.SharedIndexInformer, key func(any) (string, string)) *objWatch {
	w := &objWatch{phase: map[string]string{}, reached: map[string]map[string]time.Time{}, changed: make(chan struct{}, 1), done: make(chan struct{})}
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(ns))
	inf := informer(f)
	set := func(o any) {
		name, phase := key(o)
		if name == "" {
			return
		}
		now := time.Now()
		w.mu.Lock()
		w.phase[name] = phase
		if w.reached[phase] == nil {
			w.reached[phase] = map[string]time.Time{}
		}
		if _, ok := w.reached[phase][name]; !ok {
			w.reached[phase][name] = now
		}
		on := w.onChange
		w.mu.Unlock()
		if on != nil {
			on(o)
		}
		w.signal()
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    set,
		UpdateFunc: func(_, o any) { set(o) },
		DeleteFunc: func(o any) {
			if d, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = d.Obj
			}
			name, _ := key(o)
			w.mu.Lock()
			delete(w.phase, name)
			w.mu.Unlock()
			w.signal()
		},
	})
	f.Start(w.done)
	f.WaitForCacheSync(w.done)
	return w
}

func (b *nfsBench) watchPVs(class string) *objWatch {
	return newWatch(b.cs, "", func(f informers.SharedInformerFactory) cache.SharedIndexInformer {
		return f.Core().V1().PersistentVolumes().Informer()
	}, func(o any) (string, string) {
		pv := o.(*corev1.PersistentVolume)
		if pv.Spec.StorageClassName != class {
			return "", ""
		}
		return pv.Name, string(pv.Status.Phase)
	})
}

// deleteReleased makes w's handler an ideal deleter: each PV is deleted the instant it is
// seen Released.
func (w *objWatch) deleteReleased(cs kubernetes.Interface) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.onChange = func(o any) {
		pv := o.(*corev1.PersistentVolume)
		if pv.Status.Phase == corev1.VolumeReleased && pv.DeletionTimestamp == nil {
			go func() {
				_ = cs.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
			}()
		}
	}
}

func (w *objWatch) signal() {
	select {
	case w.changed <- struct{}{}:
	default:
	}
}

func (w *objWatch) stop() { close(w.done) }

// count is how many objects are in phase, or all objects for "".
func (w *objWatch) count(phase string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	if phase == "" {
		return len(w.phase)
	}
	c := 0
	for _, p := range w.phase {
		if p == phase {
			c++
		}
	}
	return c
}

// last is when the last object first reached phase.
func (w *objWatch) last(phase string) time.Time {
	w.mu.Lock()
	defer w.mu.Unlock()
	var t time.Time
	for _, at := range w.reached[phase] {
		if at.After(t) {
			t = at
		}
	}
	return t
}

// wait waits, up to 10 minutes, until cond holds, checking it on every change.
func (w *objWatch) wait(ctx context.Context, cond func() (bool, string)) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	for {
		ok, why := cond()
		if ok {
			return nil
		}
		select {
		case <-w.changed:
		case <-ctx.Done():
			return fmt.Errorf("%s: %w", why, ctx.Err())
		}
	}
}

// percentile is the p-th percentile (0..100) of ds by nearest rank, as test/bench's.
func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	return s[min(max(int(p/100*float64(len(s))+0.999999)-1, 0), len(s)-1)]
}

func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}
