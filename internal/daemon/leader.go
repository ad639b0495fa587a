package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// leaseName is the Lease the controller replicas compete for. It is the name the lib's own
// leader election used, so RBAC and running clusters keep working across the upgrade.
const leaseName = DriverName

// LeaderElectionConfig configures leader election among `dirpv controller` replicas. The
// defaults (15 s, 10 s, 2 s) are those of kubernetes-csi sidecars and of client-go.
type LeaderElectionConfig struct {
	Enabled bool
	// Namespace of the Lease; empty means the pod's own namespace ($POD_NAMESPACE, then the
	// service account's namespace).
	Namespace string
	// LeaseDuration is how long a standby waits before it takes over a lease that was not
	// renewed, after a crash for example; a leader that stops cleanly hands the lease over at once.
	LeaseDuration time.Duration
	// RenewDeadline is how long the leader keeps retrying to renew before it gives up leading.
	RenewDeadline time.Duration
	// RetryPeriod is the interval between attempts to acquire or renew.
	RetryPeriod time.Duration
	// Lease names the Lease; empty means the controller's, dirpv.io.
	Lease string
}

// errLostLease means this process stopped holding the lease while it was not shutting down.
var errLostLease = errors.New("lost the leader lease")

// runElected runs lead while this process holds the lease, until ctx is done.
//
// On shutdown (ctx done) lead is given time to drain, and only then is the lease released, so
// that the next leader starts the moment this one has stopped touching storage, not a lease
// duration later. A standby gives up waiting at once. Losing the lease for any other reason
// returns errLostLease without waiting for lead, as kubernetes-csi sidecars exit, so that
// kubelet restarts the process instead of two leaders working at once.
func runElected(ctx context.Context, client kubernetes.Interface, cfg LeaderElectionConfig, events record.EventRecorder, lead func(context.Context)) error {
	logger := klog.FromContext(ctx)
	host, err := os.Hostname()
	if err != nil {
		return fmt.Errorf("leader election identity: %w", err)
	}
	// Two processes on one host (tests, a restart racing its predecessor) must not share an identity.
	id := host + "_" + string(uuid.NewUUID())
	ns := cfg.Namespace
	if ns == "" {
		ns = podNamespace()
	}
	lease := cfg.Lease
	if lease == "" {
		lease = leaseName
	}
	lock, err := resourcelock.New(resourcelock.LeasesResourceLock, ns, lease,
		client.CoreV1(), client.CoordinationV1(), resourcelock.ResourceLockConfig{Identity: id, EventRecorder: events})
	if err != nil {
		return fmt.Errorf("leader election lock: %w", err)
	}

	// The elector's context is not ctx: it ends when this function says so, after lead has
	// drained, because cancelling it is what releases the lease.
	electCtx, release := context.WithCancel(context.WithoutCancel(ctx))
	defer release()
	var (
		mu      sync.Mutex
		started bool
	)
	drained := make(chan struct{})
	// A standby has nothing to drain.
	stopStandby := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if !started {
			release()
		}
	})
	defer stopStandby()

	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		Name:            lease,
		LeaseDuration:   cfg.LeaseDuration,
		RenewDeadline:   cfg.RenewDeadline,
		RetryPeriod:     cfg.RetryPeriod,
		ReleaseOnCancel: true,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(leading context.Context) {
				mu.Lock()
				if ctx.Err() != nil {
					// The lease was won in a race with shutdown: client-go starts this after
					// acquiring, whatever happened meanwhile, and runElected may already have
					// returned. Lead nothing; the elector releases the lease.
					mu.Unlock()
					return
				}
				started = true
				mu.Unlock()
				defer close(drained)
				// The work stops on shutdown or when the lease is lost, whichever comes first.
				work, stop := context.WithCancel(ctx)
				defer stop()
				defer context.AfterFunc(leading, stop)()
				logger.Info("Leading: starting provisioning", "identity", id)
				lead(work)
				release()
			},
			OnStoppedLeading: func() {
				logger.Info("Stopped leading", "identity", id)
			},
			OnNewLeader: func(identity string) {
				if identity != id {
					logger.Info("Another replica leads", "leader", identity)
				}
			},
		},
	})
	if err != nil {
		return fmt.Errorf("leader election: %w", err)
	}
	logger.Info("Waiting for the leader lease", "lease", ns+"/"+lease, "identity", id)
	le.Run(electCtx)

	if ctx.Err() == nil {
		return errLostLease
	}
	mu.Lock()
	wasLeader := started
	mu.Unlock()
	if wasLeader {
		<-drained
	}
	return nil
}

// podNamespace is the namespace the process runs in, as the lib and the sidecars find it.
func podNamespace() string {
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		return ns
	}
	if b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace"); err == nil {
		if ns := strings.TrimSpace(string(b)); ns != "" {
			return ns
		}
	}
	return "default"
}
