package provisioner

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/internal/blocking"
)

// copyInline is how long Provision waits for a copy before it leaves it to the background:
// copies of small trees are done by then (tens of thousands of files a second), and their
// claims bind on the first call, with no event saying that the copy goes on.
const copyInline = 2 * time.Second

// copyJobs runs the copies that start new volumes, one per claim, in the background: the lib
// calls Provision again while one runs (controller.ProvisioningInBackground), and gets the
// volume once it is done.
type copyJobs struct {
	// inline is copyInline, shorter in tests.
	inline time.Duration
	mu     sync.Mutex
	byUID  map[types.UID]*copyJob
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed bool
}

// copyJob is one claim's copy.
type copyJob struct {
	what    string
	started time.Time
	done    chan struct{}
	// Guarded by copyJobs.mu. background says that a Provision call stopped waiting for the
	// job, so that the job must make the lib call again when it is done.
	// abandoned says that nobody is to get the job's volume: discard removes it.
	finished, background, abandoned bool
	result                          made
	err                             error
	cancel                          context.CancelFunc
	discard                         func(made)
}

func newCopyJobs() *copyJobs {
	ctx, cancel := context.WithCancel(context.Background())
	return &copyJobs{inline: copyInline, byUID: map[types.UID]*copyJob{}, ctx: ctx, cancel: cancel}
}

// errCopyAbandoned ends a copy whose volume nobody is to get; its job is forgotten.
var errCopyAbandoned = errors.New("the claim is gone; its copy was removed")

// errCopyStopped refuses copies once the provisioner shuts down.
var errCopyStopped = errors.New("dirpv is shutting down; the copy starts again after the restart")

// run returns the claim's finished copy and forgets it, or starts the copy (fn, under
// timeout) if none runs, and waits up to j.inline for it. It returns nil while the copy
// goes on; done is called from the job's goroutine once a copy that nobody waited for ends,
// and discard with the volume of a copy abandoned (fn returning errCopyAbandoned, or abandon).
func (j *copyJobs) run(ctx context.Context, uid types.UID, what string, timeout time.Duration,
	fn func(context.Context) (made, error), done func(made, error, time.Duration), discard func(made),
) (*copyJob, error) {
	j.mu.Lock()
	job, ok := j.byUID[uid]
	if !ok {
		if j.closed {
			j.mu.Unlock()
			return nil, errCopyStopped
		}
		logger := klog.FromContext(ctx)
		jctx, cancel := context.WithTimeout(klog.NewContext(j.ctx, logger), timeout)
		job = &copyJob{what: what, started: time.Now(), done: make(chan struct{}), cancel: cancel, discard: discard}
		j.byUID[uid] = job
		j.wg.Add(1)
		go func() {
			defer j.wg.Done()
			defer cancel()
			res, err := fn(jctx)
			if errors.Is(err, context.DeadlineExceeded) && jctx.Err() != nil {
				err = fmt.Errorf("the copy did not finish within %s (dirpv's --clone-timeout); it starts again: %w", timeout, err)
			}
			j.mu.Lock()
			job.finished, job.result, job.err = true, res, err
			if errors.Is(err, errCopyAbandoned) {
				job.abandoned = true
			}
			if job.abandoned && j.byUID[uid] == job {
				delete(j.byUID, uid)
			}
			abandoned := job.abandoned
			poke := job.background && !abandoned && j.ctx.Err() == nil
			j.mu.Unlock()
			close(job.done)
			if abandoned && err == nil {
				discard(res)
			}
			if poke {
				done(res, err, time.Since(job.started))
			}
		}()
	}
	j.mu.Unlock()
	timer := time.NewTimer(j.inline)
	defer timer.Stop()
	select {
	case <-job.done:
	case <-timer.C:
	case <-ctx.Done():
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	if !job.finished {
		job.background = true
		return nil, nil
	}
	if j.byUID[uid] == job {
		delete(j.byUID, uid)
	}
	return job, nil
}

// running reports whether a copy for the claim is under way or done but not yet taken.
func (j *copyJobs) running(uid types.UID) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	_, ok := j.byUID[uid]
	return ok
}

// abandon cancels the claim's copy and forgets it; the volume it made, if any, is discarded
// here when the copy is already done, or by the job once it ends.
func (j *copyJobs) abandon(uid types.UID) {
	j.mu.Lock()
	job, ok := j.byUID[uid]
	if ok {
		delete(j.byUID, uid)
		job.abandoned = true
		job.cancel()
	}
	done := ok && job.finished && job.err == nil
	j.mu.Unlock()
	if done {
		job.discard(job.result)
	}
}

// ClaimDeleted cancels the copy of a claim that is deleted or being deleted, and so removes
// what it copied: the lib never calls Provision for such a claim again, so without this the
// copy ran on to its end (up to --clone-timeout) for nobody, holding the storage and, on NFS,
// a copy slot. The claim is read back first, off the caller's goroutine (an informer's): a
// node instance's informer also reports as deleted a claim that was only relabelled for
// another node, and that one is not the user's to lose.
func (p *Provisioner) ClaimDeleted(ctx context.Context, claim *v1.PersistentVolumeClaim) {
	if !p.copies.running(claim.UID) {
		return
	}
	logger := klog.FromContext(ctx).WithValues("claim", klog.KObj(claim))
	go func() {
		get, cancel := context.WithTimeout(context.WithoutCancel(ctx), apiTimeout)
		defer cancel()
		c, err := p.cfg.Client.CoreV1().PersistentVolumeClaims(claim.Namespace).Get(get, claim.Name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err), err == nil && (c.UID != claim.UID || c.DeletionTimestamp != nil):
		case err != nil:
			logger.Error(err, "Cannot tell whether a claim whose copy runs was deleted; the copy goes on")
			return
		default:
			return
		}
		logger.Info("Cancelling the copy of a deleted claim and removing what it copied")
		p.copies.abandon(claim.UID)
	}()
}

// stop cancels the copies under way and waits for them up to wait: a copy stops between two
// entries, and its temporary directory is removed by the next attempt.
func (j *copyJobs) stop(wait time.Duration) bool {
	j.mu.Lock()
	j.closed = true
	j.mu.Unlock()
	j.cancel()
	return blocking.WaitGroup(&j.wg, time.After(wait))
}
