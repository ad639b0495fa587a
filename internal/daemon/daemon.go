// Package daemon wires dirpv's processes together: Kubernetes clients, the provisioning
// controller, the CSI node plugin, and the HTTP endpoints for health and metrics. cmd/dirpv
// only turns flags into the configs here.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/rpc"
	provisionercontroller "github.com/kubernetes-csi/external-provisioner/v5/pkg/controller"
	resizecontroller "github.com/kubernetes-csi/external-resizer/pkg/controller"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"
	libmetrics "sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller/metrics"

	"github.com/dirpv/dirpv/internal/route"
	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/volume"
)

// DriverName is both the provisioner name and the CSI driver name.
const DriverName = "dirpv.io"

// Version is set at build time with -ldflags "-X github.com/dirpv/dirpv/internal/daemon.Version=...".
var Version = "dev"

// KubeConfig says how to reach the API server.
type KubeConfig struct {
	// Path of a kubeconfig file; empty means in-cluster.
	Path  string
	QPS   float32
	Burst int
}

func (k KubeConfig) restConfig() (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if k.Path != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", k.Path)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes client config: %w", err)
	}
	cfg.QPS, cfg.Burst = k.QPS, k.Burst
	cfg.UserAgent = "dirpv/" + Version
	return cfg, nil
}

func (k KubeConfig) client() (kubernetes.Interface, error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, err
	}
	// Every type dirpv reads and writes is built in, so protobuf works, as for kube-scheduler
	// and kube-controller-manager: the initial list of every claim and volume decodes with far
	// fewer transient allocations (the process's peak heap) and less CPU than JSON.
	cfg.ContentType = runtime.ContentTypeProtobuf
	cfg.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	// Each clientset made from a config without a RateLimiter gets a limiter of its own.
	events, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client for events: %w", err)
	}
	return withEventsApart(client, events), nil
}

// leaseClient is the client of leader election: a clientset of its own, and so a rate limiter
// of its own, as external-provisioner's. On the provisioning client a renewal waited its turn
// behind every call of a busy leader's workers, and a leader whose calls were throttled for
// longer than the renew deadline lost its lease and exited in the middle of its work.
func (k KubeConfig) leaseClient() (kubernetes.Interface, error) {
	cfg, err := k.restConfig()
	if err != nil {
		return nil, err
	}
	// A few calls every retry period: the process's own limits are ample for them.
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client for leader election: %w", err)
	}
	return client, nil
}

// ProvisionerConfig tunes the provisioning controller in either process.
type ProvisionerConfig struct {
	Workers          int
	OperationTimeout time.Duration
	// Resync is the informers' resync period; the lib retries failed claims on its own queue.
	Resync time.Duration
	// CloneTimeout bounds each copy that starts a volume from a data source or makes a
	// VolumeSnapshot.
	CloneTimeout time.Duration
	// CopySpaceMargin is the free space, in bytes, a copy must leave on its base beyond its
	// source's usage (provisioner.Config.CopySpaceMargin).
	CopySpaceMargin uint64
	// RetryIntervalStart and RetryIntervalMax bound the back-off between retries of a failed
	// Provision or Delete: it starts at the one and doubles up to the other; zero means
	// DefaultRetryIntervalStart and DefaultRetryIntervalMax. Retries never stop (retryLimiter).
	RetryIntervalStart, RetryIntervalMax time.Duration
	// Adopt names other provisioners whose PVs dirpv applies reclaim to (provisioner.Config.Adopt).
	Adopt []string
}

// The back-off defaults. The start is the lib's own: a refused claim's first retry comes no
// sooner than before. The cap is the lib's slow-retry interval for refusals (InvalidArgument,
// see provisioner.invalid) and external-provisioner's --retry-interval-max: a volume whose
// storage comes back is served within 5 minutes, and a thousand volumes failing on a dead
// server cost a few retries a second.
const (
	DefaultRetryIntervalStart = 15 * time.Second
	DefaultRetryIntervalMax   = 5 * time.Minute
)

// retryOptions returns the lib options that make a failed Provision or Delete retried for as
// long as it fails, each claim and volume backing off from RetryIntervalStart to
// RetryIntervalMax, all of them together at most 10 retries a second (the lib's own overall
// limit). The lib's default gives up after 15 failures, about 2.75 h with its back-off: a
// long NFS outage during Delete, or a long clone (whose Provision returns "in background"
// errors while it copies), then left the volume untouched until the claim or PV changed or
// the informers resynced. A refusal no retry can fix still waits the lib's slow-retry
// interval between attempts (its infeasible check runs before Provision is called): the
// queue only brings it back to that check.
func retryOptions(cfg ProvisionerConfig) []func(*controller.ProvisionController) error {
	return []func(*controller.ProvisionController) error{
		// 0: no threshold, retry forever.
		controller.FailedProvisionThreshold(0),
		controller.FailedDeleteThreshold(0),
		controller.RateLimiter(retryLimiter(cfg)),
	}
}

// retryLimiter is the rate limiter of the lib's claim and volume queues (retryOptions).
func retryLimiter(cfg ProvisionerConfig) workqueue.TypedRateLimiter[string] {
	start, maxDelay := cfg.RetryIntervalStart, cfg.RetryIntervalMax
	if start <= 0 {
		start = DefaultRetryIntervalStart
	}
	if maxDelay <= 0 {
		maxDelay = DefaultRetryIntervalMax
	}
	return workqueue.NewTypedMaxOfRateLimiter(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](start, max(maxDelay, start)),
		&workqueue.TypedBucketRateLimiter[string]{Limiter: rate.NewLimiter(rate.Limit(10), 100)},
	)
}

// ControllerConfig configures `dirpv controller`.
type ControllerConfig struct {
	Kube        KubeConfig
	Provisioner ProvisionerConfig
	// WorkDir holds the controller's mounts of NFS exports.
	WorkDir        string
	IdleUnmount    time.Duration
	LeaderElection LeaderElectionConfig
	HTTPAddress    string
	// Profiling serves Go's /debug/pprof/ on HTTPAddress too.
	Profiling bool
	// Capacity publishes CSIStorageCapacity for the NFS classes that the scheduler checks.
	Capacity CapacityConfig
	// WedgedExportLimit is how long an NFS export may have every call slot held by calls its
	// server does not answer before /healthz fails, so that kubelet restarts the controller.
	// Zero or less disables the check.
	WedgedExportLimit time.Duration
}

// checkKernel is volume.CheckKernel, replaceable in tests.
var checkKernel = volume.CheckKernel

// RunController serves NFS classes until ctx is done. With leader election, only the replica
// holding the lease provisions; on shutdown it finishes its work, releases its NFS mounts and
// then the lease, and returns nil. It returns an error if the lease is lost while running.
func RunController(ctx context.Context, cfg ControllerConfig) error {
	tuneGC()
	if err := checkKernel(); err != nil {
		return err
	}
	client, err := cfg.Kube.client()
	if err != nil {
		return err
	}
	reg := newRegistry()
	factory := newInformerFactory(client, cfg.Provisioner.Resync)
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	defer broadcaster.Shutdown()
	events := broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: DriverName + "-controller"})
	snapClient, err := cfg.Kube.snapshotClient()
	if err != nil {
		return err
	}
	p, err := provisioner.New(provisioner.Config{
		Events:           events,
		DriverName:       DriverName,
		Role:             provisioner.RoleController,
		Snapshots:        snapClient,
		Client:           client,
		Classes:          factory.Storage().V1().StorageClasses().Lister(),
		Mounter:          mount.New(""),
		WorkDir:          cfg.WorkDir,
		OperationTimeout: cfg.Provisioner.OperationTimeout,
		CloneTimeout:     cfg.Provisioner.CloneTimeout,
		CopySpaceMargin:  cfg.Provisioner.CopySpaceMargin,
		IdleUnmount:      cfg.IdleUnmount,
		Adopt:            cfg.Provisioner.Adopt,
	})
	if err != nil {
		return err
	}
	// Only the leader publishes: every replica would write the same objects.
	pub, err := newCapacityPublisher(client, factory.Storage().V1().StorageClasses(), p, cfg.Capacity,
		driverOwner(client), DriverName+"-controller", cfg.Provisioner.OperationTimeout)
	if err != nil {
		return err
	}
	// Resizing and snapshotting NFS volumes are the leader's too (provisioning): each claim has
	// one instance that resizes it, each snapshot one that takes it.
	snapshots := snapshotting(snapClient, client, p.Snapshotter(factory.Core().V1().PersistentVolumes().Lister()), "", cfg.Provisioner, reg, pub)
	provision := provisioning(ctx, client, factory, p, cfg.Provisioner, reg, pub, snapshots)
	// The leader labels local claims and PVs with their node: node instances see nothing else.
	router, err := route.New(client, DriverName, cfg.Provisioner.OperationTimeout, factory.Core().V1().PersistentVolumeClaims(),
		factory.Core().V1().PersistentVolumes(), factory.Storage().V1().StorageClasses())
	if err != nil {
		return err
	}
	protect := cloningProtection(client, factory, cfg.Provisioner.Workers)
	lead := func(ctx context.Context) {
		routed := make(chan struct{})
		go func() {
			defer close(routed)
			router.Run(ctx, cfg.Provisioner.Workers)
		}()
		protected := make(chan struct{})
		go func() {
			defer close(protected)
			protect(ctx)
		}()
		provision(ctx)
		<-routed
		<-protected
	}
	run := func(ctx context.Context) error {
		lead(ctx)
		return nil
	}
	if cfg.LeaderElection.Enabled {
		leases, err := cfg.Kube.leaseClient()
		if err != nil {
			return err
		}
		run = func(ctx context.Context) error {
			return runElected(ctx, leases, cfg.LeaderElection, events, lead)
		}
	}
	healthy := func() error { return p.Healthy(cfg.WedgedExportLimit) }
	return runAll(ctx, httpConfig{cfg.HTTPAddress, cfg.Profiling}, reg, healthy, run, runInformers(factory))
}

// provisioning returns what runs the lib's ProvisionController around p, external-resizer's
// controller around p's Resizer, pub's capacity publishing if pub is not nil, and each of
// also (snapshots) until its context is done, and registers the lib's metrics and dirpv's own
// on reg. What it returns comes back only once the controllers' workers and also have
// returned and p has released its NFS mounts and local bases, in that order: a worker still
// running after the release could mount an export again, or use a closed base.
func provisioning(ctx context.Context, client kubernetes.Interface, factory informers.SharedInformerFactory,
	p *provisioner.Provisioner, cfg ProvisionerConfig, reg *prometheus.Registry, pub *capacityPublisher,
	also ...func(context.Context),
) func(context.Context) {
	m := libmetrics.New("dirpv")
	reg.MustRegister(
		m.PersistentVolumeClaimProvisionTotal, m.PersistentVolumeClaimProvisionFailedTotal,
		m.PersistentVolumeClaimProvisionDurationSeconds, m.PersistentVolumeDeleteTotal,
		m.PersistentVolumeDeleteFailedTotal, m.PersistentVolumeDeleteDurationSeconds,
	)
	reg.MustRegister(cachedObjects(factory)...)
	// pc.Run returns as soon as its context ends, while its workers may still be in Provision
	// or Delete; the lib adds each worker to this group so that we can wait for them.
	var workers sync.WaitGroup
	pc := controller.NewProvisionController(ctx, client, DriverName, pub.wrap(provisioner.Instrument(p, reg)), append(retryOptions(cfg),
		// Leader election, where there is one, is ours (runElected): the lib's exits the process
		// when it stops leading, before anything could drain or the lease be released.
		controller.LeaderElection(false),
		controller.Threadiness(cfg.Workers),
		controller.ResyncPeriod(cfg.Resync),
		// The lib's informers are the process's shared, trimmed ones (newInformerFactory). They
		// run from startup, in a standby controller too, so that a new leader starts with a
		// warm cache instead of listing every claim and volume when it takes over.
		controller.ClaimsInformer(factory.Core().V1().PersistentVolumeClaims().Informer()),
		controller.VolumesInformer(factory.Core().V1().PersistentVolumes().Informer()),
		controller.ClassesInformer(factory.Storage().V1().StorageClasses().Informer()),
		controller.MetricsInstance(m),
		controller.AdditionalProvisionerNames(cfg.Adopt),
		// The lib's own metrics server would listen on the default mux; ours serves them.
		controller.MetricsPort(0),
		// Without the finalizer, a PV deleted before its claim (or a Released PV deleted by
		// hand) vanishes without onDelete ever running, and its directory is orphaned. Every
		// instance sets it, since an instance without it removes it from every PV it sees.
		controller.AddFinalizer(true),
	)...)
	pc.ControllerWaitGroup(&workers)
	// The lib forgets a deleted claim; a copy under way for it is dirpv's to stop, as soon as
	// the claim is being deleted.
	if _, err := factory.Core().V1().PersistentVolumeClaims().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			if claim, ok := obj.(*corev1.PersistentVolumeClaim); ok && claim.DeletionTimestamp != nil {
				p.ClaimDeleted(ctx, claim)
			}
		},
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if claim, ok := obj.(*corev1.PersistentVolumeClaim); ok {
				p.ClaimDeleted(ctx, claim)
			}
		},
	}); err != nil {
		klog.FromContext(ctx).Error(err, "Copies of deleted claims will run to their end")
	}
	resizer := p.Resizer(ctx)
	resize := resizing(client, factory, resizer, cfg)
	return func(ctx context.Context) {
		logger := klog.FromContext(ctx)
		housekeeping, stop := context.WithCancel(context.WithoutCancel(ctx))
		released := make(chan struct{})
		go func() {
			defer close(released)
			p.Run(housekeeping)
		}()
		published := make(chan struct{})
		go func() {
			defer close(published)
			if pub != nil {
				pub.run(ctx)
			}
		}()
		resized := make(chan struct{})
		go func() {
			defer close(resized)
			resize(ctx)
		}()
		var others sync.WaitGroup
		for _, fn := range also {
			others.Go(func() { fn(ctx) })
		}
		pc.Run(ctx)
		start := time.Now()
		workers.Wait()
		<-published
		<-resized
		others.Wait()
		// The resize controller's Run does not wait for its workers: the Resizer does.
		resizer.Drain()
		stop()
		<-released
		logger.Info("Provisioning stopped: workers finished and mounts released", "drainDuration", time.Since(start))
	}
}

// cloningProtection returns what runs external-provisioner's CloningProtectionController
// until its context is done. The instance that copies a claim (the controller for NFS, the
// source's node for local) puts provisioner.FinalizerCloningProtection on it; this controller
// removes it from a claim being deleted once no Pending claim names it as data source. It
// needs the whole cluster's claims, so it runs in the leader of dirpv controller, and in node
// instances only where there is no controller (nodeAlso).
func cloningProtection(client kubernetes.Interface, factory informers.SharedInformerFactory, workers int) func(context.Context) {
	claims := factory.Core().V1().PersistentVolumeClaims()
	cc := provisionercontroller.NewCloningProtectionController(client, claims.Lister(), claims.Informer(),
		workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[any]()),
		// It runs only for drivers that can clone.
		rpc.ControllerCapabilitySet{csi.ControllerServiceCapability_RPC_CLONE_VOLUME: true})
	return func(ctx context.Context) { cc.Run(ctx, max(1, workers/4)) }
}

// resizeRetryMax bounds the resize controller's backoff after a failed resize, and is how
// long it waits before trying again a size it found infeasible; external-resizer's default.
const resizeRetryMax = 5 * time.Minute

// resizing returns what runs external-resizer's controller around r until its context is
// done. It shares the process's informers (newInformerFactory), so it adds no watch: it reads
// claims and volumes, which provisioning watches anyway, and patches claims' status and PVs'
// capacity from its cached copies (a diff, which the trimmed fields are absent from on both
// sides). Its Run does not wait for its workers: r.Drain does.
func resizing(client kubernetes.Interface, factory informers.SharedInformerFactory, r *provisioner.Resizer, cfg ProvisionerConfig) func(context.Context) {
	rc := resizecontroller.NewResizeController(r.Name(), r, client, cfg.Resync, factory,
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, resizeRetryMax),
		// A limit holds on a mounted volume as on any other: no claim waits for its pods to go,
		// so the controller needs no pod informer.
		false, resizeRetryMax)
	return func(ctx context.Context) { rc.Run(cfg.Workers, ctx) }
}

// runInformers runs the shared informers until ctx is done.
func runInformers(factory informers.SharedInformerFactory) func(context.Context) error {
	return func(ctx context.Context) error {
		factory.Start(ctx.Done())
		<-ctx.Done()
		factory.Shutdown()
		return nil
	}
}

func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

// httpConfig says where to serve /healthz and /metrics (no server if address is empty), and
// whether to serve /debug/pprof/ there too.
type httpConfig struct {
	address   string
	profiling bool
}

// runAll runs every function until ctx is done or one fails, plus the HTTP server for
// /healthz (ready reports nil once the process can serve) and /metrics.
func runAll(ctx context.Context, hc httpConfig, reg *prometheus.Registry, ready func() error, fns ...func(context.Context) error) error {
	httpAddress := hc.address
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	errs := make(chan error, len(fns)+1)
	for _, fn := range fns {
		go func() { errs <- fn(ctx) }()
	}
	running := len(fns)
	if httpAddress != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		if hc.profiling {
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
			mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
			mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		}
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
			if ready != nil {
				if err := ready(); err != nil {
					http.Error(w, err.Error(), http.StatusServiceUnavailable)
					return
				}
			}
			fmt.Fprintln(w, "ok")
		})
		srv := &http.Server{Addr: httpAddress, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		ln, err := net.Listen("tcp", httpAddress)
		if err != nil {
			return fmt.Errorf("listen for health and metrics on %s: %w", httpAddress, err)
		}
		klog.FromContext(ctx).Info("Serving /healthz and /metrics", "address", ln.Addr().String())
		go func() {
			<-ctx.Done()
			shutdown, done := context.WithTimeout(context.Background(), 5*time.Second)
			defer done()
			srv.Shutdown(shutdown)
		}()
		running++
		go func() {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				errs <- fmt.Errorf("health and metrics server: %w", err)
				return
			}
			errs <- nil
		}()
	}
	var first error
	for ; running > 0; running-- {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel(err)
		} else if first == nil {
			// One part stopped: stop the rest too.
			cancel(nil)
		}
	}
	return first
}
