package node_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/bench/benchkit"
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
)

// benchKCMArgs are test/bench's default kube-controller-manager client limits ("-kcm fast"):
// with its defaults (20/30) it binds ~5 claims/s and hides any provisioner's own cost.
var benchKCMArgs = []string{"--kube-api-qps=200", "--kube-api-burst=400"}

// TestBenchNFS measures, through the guest's kernel NFS client and server, what make bench's
// NFS rows say: N claims of an NFS class create->all Bound, their deletion until PVs and
// directories are gone, and NodePublish+NodeUnpublish of an NFS volume. Each row has its
// references measured in the same run: the binding ceiling of this cluster (N pre-made PVs,
// an ideal deleter), and in the guest, through the same export and mount options, an ideal
// external provisioner and deleter (test/bench's, plus the directory), the storage floor
// (mkdir and rmdir of N directories, 16 at a time) and a bare mount+umount. dirpv runs in the
// guest under emulation, so its figures compare with those of the guest, not with the host's.
func TestBenchNFS(t *testing.T) {
	out := os.Getenv(benchEnv)
	if out == "" {
		t.Skipf("%s is not set: make bench runs this (test/bench's NFS phase), make test does not", benchEnv)
	}
	n, pubN := envInt(t, benchNEnv, 500), envInt(t, benchPublishEnv, 100)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	rep := benchkit.GuestReport{N: n, PublishN: pubN, Figures: map[string]float64{}}
	fig := rep.Figures
	add := func(r benchkit.Row) {
		t.Log(r.Line(52))
		rep.Rows = append(rep.Rows, r)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", suite.Cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	// The bench's own client must never be what limits a run.
	cfg.QPS, cfg.Burst = 5000, 10000
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The install waited for the node plugin only: a controller still starting under emulation
	// would count its start in the first timed run.
	if err := framework.Poll(ctx, 5*time.Minute, func(context.Context) (bool, error) {
		_, err := controllerMetrics(ctx)
		return err == nil, err
	}); err != nil {
		t.Fatalf("dirpv's controller in the guest does not serve its metrics: %v", err)
	}
	share, options := "/", []string{"nfsvers=4.2", "hard"}
	floor := node.BenchRequest{Source: node.NFSAddr + ":" + share, Options: options}
	claims := func(ns, class string) func(i int) *corev1.PersistentVolumeClaim {
		return func(i int) *corev1.PersistentVolumeClaim {
			return framework.NewClaim(ns, fmt.Sprintf("c-%04d", i), class, framework.AccessModes(corev1.ReadWriteMany), framework.Request("16Mi"))
		}
	}
	bind := func(ns, class string, n int) time.Duration {
		t.Helper()
		d, _, err := benchkit.Bind(ctx, cs, ns, n, benchkit.Creator(ctx, cs, claims(ns, class)), 10*time.Minute, nil)
		if err != nil {
			t.Fatalf("%v\nevents:%s", err, framework.EventsOf(ctx, cs, ns, "PersistentVolumeClaim", "c-0000"))
		}
		return d
	}
	deleteAll := func(ns, class string, idealDeleter bool, done func() (bool, string)) time.Duration {
		t.Helper()
		d, err := benchkit.DeleteAll(ctx, cs, ns, class, idealDeleter, 10*time.Minute, done)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}

	// The binding ceiling of this cluster: N claims bound to N pre-made PVs of a class without
	// a provisioner, then deleted with an ideal deleter.
	static := suite.CreateClass(t, "bench-static", nil, framework.Provisioner("kubernetes.io/no-provisioner"), framework.Immediate)
	d, err := benchkit.Ceiling(ctx, cs, "ceil-bulk", n, claims("ceil-bulk", static.Name), 10*time.Minute, nil)
	if err != nil {
		t.Fatal(err)
	}
	fig["ceil.bulk"] = d.Seconds()
	fig["ceil.delete"] = deleteAll("ceil-bulk", static.Name, true, nil).Seconds()
	// The storage floor.
	req := floor
	req.Dirs = n
	res, err := guestNode.Bench(ctx, 10*time.Minute, req)
	if err != nil {
		t.Fatal(err)
	}
	fig["floor.mkdir"], fig["floor.rmdir"] = res.Mkdir.Seconds(), res.Rmdir.Seconds()
	// The ideal external NFS provisioner in the guest (node.StartIdeal).
	const idealProvisioner = "bench.invalid/ideal-nfs"
	ideal := suite.CreateClass(t, "bench-ideal-nfs", nil, framework.Provisioner(idealProvisioner), framework.Immediate)
	req = floor
	req.IdealProvisioner = idealProvisioner
	stop, err := guestNode.StartIdeal(ctx, req, suite.Cluster.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	fig["ideal.bulk"] = bind("ideal-bulk", ideal.Name, n).Seconds()
	fig["ideal.delete"] = deleteAll("ideal-bulk", ideal.Name, false, nil).Seconds()
	if err := stop(); err != nil {
		t.Fatal(err)
	}

	// dirpv.
	class := suite.CreateClass(t, "bench-nfs", map[string]string{"backend": "nfs", "server": node.NFSAddr, "share": share},
		framework.Immediate, framework.MountOptions(options...))
	m0, _ := controllerMetrics(ctx)
	bulk := bind("nfs-bulk", class.Name, n)
	fig["nfs.bulk"] = bulk.Seconds()
	bulkNote := since(ctx, m0, bulk)
	add(benchkit.Row{Name: fmt.Sprintf("ceiling (VM node's cluster): %d pre-made PVs, all Bound", n), Value: fig["ceil.bulk"], Unit: "s"})
	add(benchkit.Row{Name: fmt.Sprintf("floor: mkdir %d dirs, kernel NFS client (VM)", n), Value: res.Mkdir.Seconds(), Unit: "s",
		Note: fmt.Sprintf("%d at a time, through a mount of %s with %v", benchkit.Parallelism, floor.Source, options)})
	add(benchkit.Row{Name: fmt.Sprintf("ideal external NFS provisioner in the VM: %d claims", n), Value: fig["ideal.bulk"], Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.bulk"], Note: "a directory through the kernel client and a PV per claim, in the guest"})
	add(benchkit.Row{Name: fmt.Sprintf("dirpv nfs (kernel, VM): %d claims create->all Bound", n), Value: bulk.Seconds(), Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.bulk"],
		Note: fmt.Sprintf("%.2fx the ideal external provisioner in the guest; %.1fx the mkdir floor; %s", bulk.Seconds()/fig["ideal.bulk"], bulk.Seconds()/res.Mkdir.Seconds(), bulkNote)})
	t.Logf("(%.2fx the ideal external NFS provisioner in the guest; %s)", bulk.Seconds()/fig["ideal.bulk"], bulkNote)
	m0, _ = controllerMetrics(ctx)
	del := deleteAll("nfs-bulk", class.Name, false, exportEmpty(ctx))
	delNote := since(ctx, m0, del)
	fig["nfs.delete"] = del.Seconds()
	add(benchkit.Row{Name: fmt.Sprintf("ceiling (VM node's cluster): delete %d, ideal deleter", n), Value: fig["ceil.delete"], Unit: "s"})
	add(benchkit.Row{Name: fmt.Sprintf("floor: rmdir %d dirs, kernel NFS client (VM)", n), Value: res.Rmdir.Seconds(), Unit: "s"})
	add(benchkit.Row{Name: fmt.Sprintf("ideal NFS deleter in the VM: delete %d", n), Value: fig["ideal.delete"], Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.delete"], Note: "rmdir through the kernel client, then the PV, in the guest"})
	add(benchkit.Row{Name: fmt.Sprintf("dirpv nfs (kernel, VM): delete %d, PVs+dirs gone", n), Value: del.Seconds(), Unit: "s",
		Ref: "ceiling (VM)", RefValue: fig["ceil.delete"],
		Note: fmt.Sprintf("%.2fx the ideal deleter in the guest; %.1fx the rmdir floor; %s", del.Seconds()/fig["ideal.delete"], del.Seconds()/res.Rmdir.Seconds(), delNote)})
	t.Logf("(%.2fx the ideal NFS deleter in the guest; %s)", del.Seconds()/fig["ideal.delete"], delNote)

	// NodePublish of one of the class's volumes, against a bare mount of the same export.
	bind("nfs-publish", class.Name, 1)
	pv, err := framework.WaitForBoundPV(ctx, cs, "nfs-publish", "c-0000", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	req = floor
	req.Source = node.NFSAddr + ":" + path.Join(share, pv.Spec.CSI.VolumeAttributes["path"])
	req.Publish, req.Rounds, req.VolumeID, req.Attrs = pubN, 5, pv.Spec.CSI.VolumeHandle, pv.Spec.CSI.VolumeAttributes
	req.PodUID = runningPodUID(ctx, t, cs)
	if res, err = guestNode.Bench(ctx, 20*time.Minute, req); err != nil {
		t.Fatal(err)
	}
	for _, q := range []float64{50, 95} {
		p := fmt.Sprintf("p%.0f", q)
		m, pub := benchkit.MS(benchkit.Percentile(res.Mount, q)), benchkit.MS(benchkit.Percentile(res.Publish, q))
		fig["nfs.mu."+p], fig["nfs.pub."+p] = m, pub
		add(benchkit.Row{Name: "bare NFS mount+umount, mount-utils (VM) " + p, Value: m, Unit: "ms"})
		add(benchkit.Row{Name: "dirpv NFS NodePublish+NodeUnpublish (VM) " + p, Value: pub, Unit: "ms",
			Ref: "mount-utils NFS mount", RefValue: m})
	}

	// A restarted dirpv process would have counted its start in a figure.
	pods, err := cs.CoreV1().Pods("dirpv").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		for _, c := range p.Status.ContainerStatuses {
			if c.RestartCount > 0 {
				prev, err := cs.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{Container: c.Name, Previous: true, TailLines: ptr.To[int64](15)}).DoRaw(ctx)
				if err != nil {
					prev = []byte(err.Error())
				}
				t.Errorf("pod %s container %s restarted %d times during the bench: its figures include a start; last state %+v; the end of its previous log:\n%s",
					p.Name, c.Name, c.RestartCount, c.LastTerminationState, prev)
			}
		}
	}
	rep.Seconds = time.Since(start).Seconds()
	j, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, append(j, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("NFS bench through the guest's kernel: %s; rows in %s", time.Since(start).Round(time.Second), out)
}

// The controller's figures that say where its time goes: its CPU, the provisioning
// library's operation (event, dirpv's Provision, PV create) and dirpv's Provision alone.
const (
	metricCPU       = "process_cpu_seconds_total"
	metricLibOp     = "dirpv_persistentvolumeclaim_provision_duration_seconds"
	metricProvision = "dirpv_provision_duration_seconds"
)

// controllerMetrics scrapes dirpv's controller, which runs on the guest's host network
// (deploy/'s --http-address=:9809).
func controllerMetrics(ctx context.Context) (map[string]float64, error) {
	return benchkit.Metrics(ctx, "http://"+node.GuestAddr+":9809/metrics")
}

// since says what the controller did since it was scraped as before, a span of d: its CPU,
// and the mean library operation and dirpv Provision of the claims provisioned meanwhile.
func since(ctx context.Context, before map[string]float64, d time.Duration) string {
	now, err := controllerMetrics(ctx)
	if err == nil && before == nil {
		err = errors.New("no scrape at the start")
	}
	if err != nil {
		return fmt.Sprintf("controller metrics: %v", err)
	}
	delta := func(name string) float64 { return benchkit.Sum(now, name) - benchkit.Sum(before, name) }
	out := fmt.Sprintf("controller CPU %.1f s (%.0f%% of one CPU)", delta(metricCPU), 100*delta(metricCPU)/d.Seconds())
	if c := delta(metricLibOp + "_count"); c > 0 {
		out += fmt.Sprintf(", mean library op %.0f ms", 1000*delta(metricLibOp+"_sum")/c)
	}
	if c := delta(metricProvision + "_count"); c > 0 {
		out += fmt.Sprintf(", of it dirpv's Provision %.0f ms", 1000*delta(metricProvision+"_sum")/c)
	}
	return out
}

// exportEmpty holds once the export has none of the deleted claims' directories, in the
// trash (from which dirpv removes them in the background) or out of it.
func exportEmpty(ctx context.Context) func() (bool, string) {
	trash := volume.ReservedPrefix + "trash"
	list := fmt.Sprintf("cd %s && ls -A && echo -- && { ls -A %s 2>/dev/null || true; }", node.NFSExportDir, trash)
	return func() (bool, string) {
		out, err := guestNode.Exec(ctx, time.Minute, "sh", "-c", list)
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
	}
}

// runningPodUID is the UID of one of dirpv's own pods on the guest node: the publish bench's
// targets go in that pod's directory, which kubelet leaves alone while the pod runs (it removes
// what it finds in its pods directory for no pod).
func runningPodUID(ctx context.Context, t *testing.T, cs kubernetes.Interface) string {
	pods, err := cs.CoreV1().Pods("dirpv").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + guestNode.Name})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.Status.Phase == corev1.PodRunning {
			return string(p.UID)
		}
	}
	t.Fatalf("no running pod of dirpv on node %s among %d", guestNode.Name, len(pods.Items))
	return ""
}

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
