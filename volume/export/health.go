package export

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/dirpv/dirpv/internal/blocking"
)

// Status is what the controller knows about one NFS export it mounts.
type Status struct {
	// Export is server:share; mounts of it with different options are one export here.
	Export string
	// Stuck counts calls whose callers gave up waiting for the server but that still run.
	Stuck int
	// Saturated is set when every one of the export's call slots is taken, so that new calls
	// on it fail at once; SaturatedSince is since when no slot has come free.
	Saturated      bool
	SaturatedSince time.Time
	// MountLockHeldSince is since when a mount, unmount or lookup of the export's mount has
	// held its lock, zero if none does. Every step under the lock is bounded, so a lock
	// held far longer than the operation timeout means a step is hung and every call on
	// the export waits in vain.
	MountLockHeldSince time.Time
}

// Status reports on every NFS export this controller knows, one entry per server:share (exports
// mounted with different options are summed), sorted by export. It never waits on a server.
func (e *Exports) Status() []Status {
	e.mu.Lock()
	// Copies count among the stuck calls, but a copy slot taken is no sign of a dead
	// server: copies run for as long as their trees take.
	slots := make(map[string][]*blocking.Slots, len(e.byKey))
	copies := make(map[string][]*blocking.Slots, len(e.byKey))
	lockedSince := make(map[string]time.Time, len(e.byKey))
	for _, ex := range e.byKey {
		slots[ex.source] = append(slots[ex.source], ex.sem)
		copies[ex.source] = append(copies[ex.source], ex.copySem)
		if ns := ex.lockedSince.Load(); ns != 0 {
			if t, ok := lockedSince[ex.source]; !ok || time.Unix(0, ns).Before(t) {
				lockedSince[ex.source] = time.Unix(0, ns)
			}
		}
	}
	e.mu.Unlock()
	out := make([]Status, 0, len(slots))
	for source, ss := range slots {
		st := Status{Export: source, MountLockHeldSince: lockedSince[source]}
		for _, s := range ss {
			st.Stuck += s.Abandoned()
			if full := s.FullSince(); !full.IsZero() && (st.SaturatedSince.IsZero() || full.Before(st.SaturatedSince)) {
				st.Saturated, st.SaturatedSince = true, full
			}
		}
		for _, s := range copies[source] {
			st.Stuck += s.Abandoned()
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Export, b.Export) })
	return out
}

// Healthy returns an error if an NFS export has had all its call slots taken, none coming free,
// or its mount lock held, for longer than limit: every claim on it fails, and only a restart
// (which the liveness probe triggers) gets rid of calls stuck in the kernel. A limit of zero or
// less disables the check.
func (e *Exports) Healthy(limit time.Duration) error {
	if limit <= 0 {
		return nil
	}
	var wedged []string
	for _, st := range e.Status() {
		if st.Saturated && time.Since(st.SaturatedSince) > limit {
			wedged = append(wedged, fmt.Sprintf("%s (every call slot taken since %s, %d calls abandoned)",
				st.Export, st.SaturatedSince.UTC().Format(time.RFC3339), st.Stuck))
		}
		if !st.MountLockHeldSince.IsZero() && time.Since(st.MountLockHeldSince) > limit {
			wedged = append(wedged, fmt.Sprintf("%s (mount lock held since %s)",
				st.Export, st.MountLockHeldSince.UTC().Format(time.RFC3339)))
		}
	}
	if len(wedged) > 0 {
		return fmt.Errorf("NFS exports wedged for more than %s: %s", limit, strings.Join(wedged, ", "))
	}
	return nil
}

// Mounted counts the exports mounted under the work dir, as the kernel's mount table has them:
// the truth, whichever call mounted or dropped them, and readable without waiting on a server.
func (e *Exports) Mounted() (int, error) {
	mps, err := e.mounter.List()
	if err != nil {
		return 0, fmt.Errorf("list mounts: %w", err)
	}
	dir := filepath.Join(e.workDir, "exports") + string(filepath.Separator)
	n := 0
	for _, mp := range mps {
		if strings.HasPrefix(mp.Path, dir) {
			n++
		}
	}
	return n, nil
}
