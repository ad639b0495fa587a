package provisioner

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota"
)

// ReasonQuotaEscape is the reason of the Warning event on a claim whose volume holds data
// outside its size limit: files moved out of its project quota, nested btrfs subvolumes.
const ReasonQuotaEscape = "QuotaEscape"

// DefaultQuotaCheckPeriod is how often a node checks its limited local volumes for quota
// escapes by default.
const DefaultQuotaCheckPeriod = 10 * time.Minute

// escapeChecks is what the node's quota checks remember between passes.
type escapeChecks struct {
	mu sync.Mutex
	// last is each volume's last finding (by PV name), kept while there is one, so that a
	// claim gets one event per change, not one per pass.
	last map[string]volume.Escapes
	// next is the PV name the next pass starts at: a pass its deadline stops leaves the rest
	// to the next one rather than starting again from the same volumes.
	next string
	// repaired counts the files and directories moved back into their volume's project;
	// passes the passes that checked every volume.
	repaired, passes int
}

// runQuotaChecks checks this node's limited local volumes every period until ctx is done.
func (p *Provisioner) runQuotaChecks(ctx context.Context) {
	period := p.cfg.QuotaCheckPeriod
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		// A pass ends before the next is due: a volume too big to walk in one period is
		// walked in part, logged, and the pass after it starts with the next volume.
		pass, cancel := context.WithTimeout(ctx, period)
		done := make(chan struct{})
		go func() {
			defer close(done)
			// A thread of its own at the lowest CPU and I/O priority, so that the walk yields
			// to the pods and to every other call of the plugin; the thread goes when the
			// goroutine ends locked to it, its priority with it.
			runtime.LockOSThread()
			lowerPriority(klog.FromContext(ctx))
			p.checkQuotas(pass)
		}()
		<-done
		cancel()
	}
}

// lowerPriority gives the calling thread (only: Linux applies both to a thread) nice 19 and
// the idle I/O class.
func lowerPriority(logger klog.Logger) {
	const ioprioClassIdle, ioprioClassShift, ioprioWhoProcess = 3, 13, 1
	if err := unix.Setpriority(unix.PRIO_PROCESS, 0, 19); err != nil {
		logger.V(4).Info("Quota check runs at normal CPU priority", "err", err)
	}
	if _, _, e := unix.Syscall(unix.SYS_IOPRIO_SET, ioprioWhoProcess, 0, ioprioClassIdle<<ioprioClassShift); e != 0 {
		logger.V(4).Info("Quota check runs at normal I/O priority", "err", e)
	}
}

// checkQuotas checks each bound local volume of this node that has a limit, once, until ctx
// is done.
func (p *Provisioner) checkQuotas(ctx context.Context) {
	logger := klog.FromContext(ctx)
	pvs, err := p.cfg.Volumes.List(labels.Everything())
	if err != nil {
		logger.Error(err, "Quota check: cannot list PVs")
		return
	}
	var mine []*v1.PersistentVolume
	for _, pv := range pvs {
		// Adopted PVs (no CSI source) have no limit to check.
		if p.responsibleFor(ctx, pv) == "" && pv.Spec.CSI != nil && pv.Spec.ClaimRef != nil && pv.Status.Phase == v1.VolumeBound &&
			pv.Spec.CSI.VolumeAttributes[volume.AttrQuota] != "" {
			mine = append(mine, pv)
		}
	}
	slices.SortFunc(mine, func(a, b *v1.PersistentVolume) int { return strings.Compare(a.Name, b.Name) })
	p.escapes.mu.Lock()
	start, _ := slices.BinarySearchFunc(mine, p.escapes.next, func(pv *v1.PersistentVolume, name string) int {
		return strings.Compare(pv.Name, name)
	})
	// Forget the volumes that are gone or no longer bound.
	for name := range p.escapes.last {
		if !slices.ContainsFunc(mine, func(pv *v1.PersistentVolume) bool { return pv.Name == name }) {
			delete(p.escapes.last, name)
		}
	}
	p.escapes.mu.Unlock()
	began, checked := time.Now(), 0
	for i := range mine {
		pv := mine[(start+i)%len(mine)]
		if ctx.Err() != nil {
			p.escapes.mu.Lock()
			p.escapes.next = pv.Name
			p.escapes.mu.Unlock()
			logger.Info("Quota check ran out of time; the next one starts here", "pv", pv.Name, "checked", checked, "of", len(mine))
			return
		}
		p.checkQuota(ctx, pv)
		checked++
	}
	p.escapes.mu.Lock()
	p.escapes.next = ""
	p.escapes.passes++
	p.escapes.mu.Unlock()
	logger.V(4).Info("Quota check done", "volumes", checked, "duration", time.Since(began))
}

// checkQuota checks one volume, repairs what it can, and tells the claim what it found if that
// changed since the last check.
func (p *Provisioner) checkQuota(ctx context.Context, pv *v1.PersistentVolume) {
	logger := klog.FromContext(ctx).WithValues("pv", pv.Name, "claim", klog.KRef(pv.Spec.ClaimRef.Namespace, pv.Spec.ClaimRef.Name))
	attrs, err := volume.ParseAttributes(pv.Spec.CSI.VolumeAttributes)
	if err != nil {
		logger.Error(err, "Quota check: bad PV attributes")
		return
	}
	// A base that must be a mount point and is not holds no volume to check (Delete too).
	attrs.BaseMountPoint = mountPointRequired(pv)
	// Not beside a resize or Delete of the same volume: a file moved back into a project
	// that Delete has just released would keep its limit from being cleared.
	unlock, err := p.lockVolume(ctx, attrs)
	if err != nil {
		return // the pass's time is up
	}
	defer unlock()
	var found volume.Escapes
	err = p.onStore(ctx, attrs, nil, func(root *volume.Root) error {
		vol, err := root.OpenVolumeOf(attrs.Path, claimOf(pv))
		if err != nil || vol == nil {
			return err
		}
		defer vol.Close()
		found, err = vol.FindEscapes(ctx, true)
		return err
	})
	if err != nil {
		// What was found before the error (a deadline, a repair refused) is still reported.
		logger.Error(err, "Quota check of a volume failed", "path", attrs.Path, "found", found.Found, "walked", found.Walked)
	}
	if found.Repaired > 0 {
		logger.Info("Moved files back into their volume's project quota", "path", attrs.Path, "repaired", found.Repaired, "example", found.Example)
	}
	p.escapes.mu.Lock()
	p.escapes.repaired += found.Repaired
	last, seen := p.escapes.last[pv.Name]
	if found.Found == 0 {
		delete(p.escapes.last, pv.Name)
	} else {
		if p.escapes.last == nil {
			p.escapes.last = map[string]volume.Escapes{}
		}
		p.escapes.last[pv.Name] = found
	}
	p.escapes.mu.Unlock()
	if found.Found == 0 || seen && last.Found == found.Found && last.Example == found.Example && last.Repaired == found.Repaired {
		return
	}
	msg := escapeMessage(found)
	logger.Info("Quota escape found", "path", attrs.Path, "found", found.Found, "example", found.Example, "repaired", found.Repaired)
	if p.cfg.Events != nil {
		ref := *pv.Spec.ClaimRef
		ref.Kind, ref.APIVersion = "PersistentVolumeClaim", "v1"
		p.cfg.Events.Event(&ref, v1.EventTypeWarning, ReasonQuotaEscape, msg)
	}
}

// escapeMessage tells the claim's owner what a check found in its volume and what was done.
func escapeMessage(e volume.Escapes) string {
	if e.Kind == quota.Btrfs {
		return fmt.Sprintf("the volume holds %d nested btrfs subvolume(s), e.g. %q, whose data its size limit does not count; "+
			"dirpv cannot count them and leaves them as they are (they are removed with the volume)", e.Found, e.Example)
	}
	msg := fmt.Sprintf("%d file(s) or director(ies) of the volume had left its project quota, e.g. %q, so that what they hold "+
		"escaped the claim's size limit", e.Found, e.Example)
	switch {
	case e.Repaired == e.Found:
		return msg + "; dirpv moved them back: they count against the claim's size again"
	case e.Repaired > 0:
		return msg + fmt.Sprintf("; dirpv moved %d back, the others could not be (see the node plugin's log)", e.Repaired)
	}
	return msg + "; dirpv could not move them back (see the node plugin's log)"
}

// QuotaChecks is what the node's quota checks have found and done so far.
type QuotaChecks struct {
	// Found sums the last check's findings over this node's volumes, by kind of limit.
	Found map[quota.Kind]int
	// Repaired counts the files and directories moved back into their project; Passes the
	// passes that checked every volume.
	Repaired, Passes int
}

// QuotaChecks reports on the node's quota checks.
func (p *Provisioner) QuotaChecks() QuotaChecks {
	p.escapes.mu.Lock()
	defer p.escapes.mu.Unlock()
	q := QuotaChecks{Found: map[quota.Kind]int{quota.Project: 0, quota.Btrfs: 0}, Repaired: p.escapes.repaired, Passes: p.escapes.passes}
	for _, e := range p.escapes.last {
		q.Found[e.Kind] += e.Found
	}
	return q
}
