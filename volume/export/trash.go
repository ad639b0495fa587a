package export

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/volume"
)

// Deleting an NFS volume is two jobs with different budgets. Liveness (the server answers)
// gets the operation timeout: Delete moves the volume's directory into TrashDir at the export
// root, which takes a few calls whatever the tree's size, and the PV can go. Work (the tree
// is big) gets as long as it needs: a background walk removes the trash entry in steps,
// one walk per entry, a few per export, and the walks pick up again after a restart.

// TrashDir holds deleted NFS volumes until their trees are removed. No pathPattern can
// produce it (volume.ReservedPrefix), and it is not a volume, so nesting checks never stop there.
const TrashDir = volume.ReservedPrefix + "trash"

const (
	// maxWalksPerExport bounds the background deletes that run at once on one export.
	maxWalksPerExport = 2
	// removalStep is how many entries one step of a background delete removes.
	removalStep = 1000
	// progressEvery is how often a long background delete logs its progress.
	progressEvery = 10 * time.Second
	// retryMin and retryMax bound the wait before a failed background delete is tried again.
	retryMin, retryMax = time.Second, 5 * time.Minute
)

// trashQueue is an export's background deletes. Guarded by exports.mu.
type trashQueue struct {
	// entries maps each trash entry that is queued, being removed or waiting for a retry to
	// its failed attempts; a name in it is never queued twice.
	entries map[string]int
	queue   []string
	walkers int
}

// Trash moves the volume rel of owner to the export's trash, named after owner's PV, within
// the operation timeout and starts removing it in the background. A volume already moved (a
// retried Delete) is not moved again; its removal is started if it is not under way, for
// instance after a restart. A directory at rel that belongs to another claim is left alone
// (volume.Root.OpenVolumeOf).
func (e *Exports) Trash(ctx context.Context, server, share string, options []string, rel string, owner volume.Claim) error {
	ex := e.get(server, share, options)
	var (
		entry string
		moved bool
	)
	err := e.run(ctx, ex, func(root *volume.Root) error {
		var err error
		entry, moved, err = moveToTrash(root, rel, owner)
		return err
	})
	if err != nil {
		return err
	}
	logger := klog.FromContext(ctx)
	switch {
	case moved:
		logger.Info("Moved volume directory to the trash; removing it in the background", "path", rel, "trash", TrashDir+"/"+entry)
	case entry != "":
		logger.Info("Volume directory is in the trash already; removing it in the background", "path", rel, "trash", TrashDir+"/"+entry)
	default:
		logger.Info("Volume directory is gone already", "path", rel)
	}
	if entry != "" {
		// The walk outlives this call: its log lines name the trash entry, not this claim.
		e.enqueue(e.logger, ex, entry)
	}
	return nil
}

// TrashSnapshot moves the snapshot name to the export's trash within the operation timeout
// and starts removing it in the background, as Trash does for a volume: a snapshot is as big
// as its volume, and removing it in one call would outlast the timeout and have the export
// taken for dead, force-unmounted under every other claim's calls.
func (e *Exports) TrashSnapshot(ctx context.Context, server, share string, options []string, name string) error {
	ex := e.get(server, share, options)
	var (
		entries []string
		moved   bool
	)
	err := e.run(ctx, ex, func(root *volume.Root) error {
		var err error
		entries, moved, err = root.MoveSnapshot(name, TrashDir)
		return err
	})
	if err != nil {
		return err
	}
	logger := klog.FromContext(ctx)
	switch {
	case moved:
		logger.Info("Moved snapshot to the trash; removing it in the background", "snapshot", name, "trash", TrashDir, "entries", entries)
	case len(entries) > 0:
		logger.Info("Snapshot is in the trash already; removing it in the background", "snapshot", name, "trash", TrashDir, "entries", entries)
	}
	for _, entry := range entries {
		e.enqueue(e.logger, ex, entry)
	}
	return nil
}

// moveToTrash moves rel into TrashDir as owner's PV name, unless rel is another claim's volume.
// It returns the trash entry to remove ("" if there is none) and whether this call moved it
// there. It moves the directory it checked or nothing: another that took rel's name after the
// check is left alone.
func moveToTrash(root *volume.Root, rel string, owner volume.Claim) (string, bool, error) {
	// A stale PV's retried Delete must not send a new claim's volume at the same path to the
	// background walk, which would remove that claim's data.
	vol, err := root.OpenVolumeOf(rel, owner)
	if err != nil && !errors.Is(err, volume.ErrNotDirectory) {
		return "", false, err
	}
	if vol != nil {
		defer vol.Close()
	}
	failpoint.Reach(failpoint.DeleteChecked)
	switch {
	case err != nil:
		// A link needs no background walk; its target is left alone.
		if err := root.RemoveLink(rel); err != nil && !errors.Is(err, volume.ErrReplaced) {
			return "", false, err
		}
	case vol != nil:
		entry, err := moveChecked(root, vol, owner.PVName)
		if err == nil {
			return entry, true, nil
		}
		if !errors.Is(err, os.ErrNotExist) && !errors.Is(err, volume.ErrReplaced) {
			return "", false, err
		}
		// Removed after the check; what took its path, if anything, is not this PV's.
	}
	// Moved by an earlier attempt, whose walk may be lost with a restart, or never there.
	if _, err := root.Stat(TrashDir + "/" + owner.PVName); errors.Is(err, os.ErrNotExist) {
		return "", false, nil
	}
	return owner.PVName, false, nil
}

// moveChecked moves vol into the trash as pvName and returns the entry it got.
func moveChecked(root *volume.Root, vol *volume.Volume, pvName string) (string, error) {
	if err := root.Mkdir(TrashDir, 0o700); err != nil {
		return "", err
	}
	entry := pvName
	err := vol.Move(TrashDir, entry)
	if errors.Is(err, unix.EEXIST) {
		// Another tree with this name is still being removed (a pattern without the PV name
		// made a new volume at the same path, under a PV of the same name): keep both.
		entry = pvName + "-" + strconv.FormatInt(time.Now().UnixNano(), 36)
		if len(entry) > volume.MaxComponentLength {
			entry = entry[len(entry)-volume.MaxComponentLength:]
		}
		err = vol.Move(TrashDir, entry)
	}
	return entry, err
}

// resumeTrash queues every entry left in the trash of the export just mounted at root.
func (e *Exports) resumeTrash(logger klog.Logger, ex *export, root *volume.Root) {
	names, err := root.List(TrashDir)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	if err != nil {
		logger.Error(err, "Listing volumes left to remove", "export", ex.source, "trash", TrashDir)
		return
	}
	if len(names) > 0 {
		logger.Info("Resuming the removal of deleted volumes", "export", ex.source, "entries", len(names))
	}
	for _, name := range names {
		e.enqueue(logger, ex, name)
	}
}

// enqueue queues the removal of a trash entry unless it is already known, and starts a walk
// if the export has fewer than maxWalksPerExport.
func (e *Exports) enqueue(logger klog.Logger, ex *export, entry string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return // the entry stays in the trash; the next run resumes it
	}
	if _, ok := ex.trash.entries[entry]; ok {
		return
	}
	if ex.trash.entries == nil {
		ex.trash.entries = map[string]int{}
	}
	ex.trash.entries[entry] = 0
	e.pending++
	e.requeueLocked(logger, ex, entry)
}

// requeueLocked puts a known entry back in the queue and starts a walk if there is room.
func (e *Exports) requeueLocked(logger klog.Logger, ex *export, entry string) {
	ex.trash.queue = append(ex.trash.queue, entry)
	if ex.trash.walkers >= maxWalksPerExport {
		return
	}
	// The walk counts as a user, so that the export is not unmounted as idle under it.
	if e.background(&e.walking, func() { e.walk(logger, ex) }) {
		ex.trash.walkers++
		ex.users++
	}
}

// walk removes queued trash entries of the export until none is left or shutdown begins.
func (e *Exports) walk(logger klog.Logger, ex *export) {
	for {
		e.mu.Lock()
		if len(ex.trash.queue) == 0 || e.closed {
			ex.trash.walkers--
			ex.users--
			ex.lastUsed = time.Now()
			e.mu.Unlock()
			return
		}
		entry := ex.trash.queue[0]
		ex.trash.queue = ex.trash.queue[1:]
		e.removals++
		e.mu.Unlock()

		err := e.removeEntry(logger, ex, entry)

		e.mu.Lock()
		switch {
		case err == nil:
			delete(ex.trash.entries, entry)
			e.pending--
		case e.closed:
			// Stopped for shutdown: the next run resumes it.
		default:
			attempts := ex.trash.entries[entry] + 1
			ex.trash.entries[entry] = attempts
			delay := min(retryMin<<min(attempts-1, 20), retryMax)
			logger.Error(err, "Removing a deleted volume; trying again later", "export", ex.source,
				"trash", TrashDir+"/"+entry, "attempts", attempts, "retryIn", delay)
			e.background(&e.running, func() {
				t := time.NewTimer(delay)
				defer t.Stop()
				select {
				case <-t.C:
				case <-e.bg.Done():
					return
				}
				e.mu.Lock()
				defer e.mu.Unlock()
				e.requeueLocked(logger, ex, entry)
			})
		}
		e.mu.Unlock()
	}
}

// removeEntry removes one trash entry in steps of removalStep entries.
func (e *Exports) removeEntry(logger klog.Logger, ex *export, entry string) error {
	ctx, cancel := context.WithTimeout(e.bg, e.timeout)
	root, _, err := e.acquire(ctx, ex)
	cancel()
	if err != nil {
		return err
	}
	// The walk's own handles keep the mount from going away under it; were it dropped
	// meanwhile, it detaches and the walk carries on until this handle is closed.
	defer root.Close()
	rel := TrashDir + "/" + entry
	logger = logger.WithValues("export", ex.source, "trash", rel)
	var rm *volume.Removal
	if err := e.step(logger, func() error {
		var err error
		rm, err = root.StartRemoval(rel)
		return err
	}); err != nil {
		return err
	}
	defer rm.Close()
	start, lastLog, removed := time.Now(), time.Now(), 0
	for {
		var (
			n    int
			done bool
		)
		err := e.step(logger, func() error {
			var err error
			n, done, err = rm.Step(removalStep)
			return err
		})
		removed += n
		if err != nil {
			return err
		}
		if done {
			logger.Info("Removed deleted volume", "entries", removed, "duration", time.Since(start).Round(time.Millisecond))
			return nil
		}
		if time.Since(lastLog) >= progressEvery {
			lastLog = time.Now()
			logger.Info("Removing deleted volume", "entriesRemoved", removed, "elapsed", time.Since(start).Round(time.Second))
		}
	}
}

// step runs one step of a background delete. A step that outlives the operation timeout
// means the server stopped answering: the walk pauses and says so, and leaves the export
// alone, since other claims on it judge the server with their own deadlines. The step is
// waited for, not abandoned, since the next one carries on from its state and a second walk
// of the same tree is what this design avoids.
func (e *Exports) step(logger klog.Logger, fn func() error) error {
	start := time.Now()
	paused := time.AfterFunc(e.timeout, func() {
		logger.Info("Background delete paused: the NFS server has not answered", "waited", e.timeout)
	})
	defer func() {
		if !paused.Stop() {
			logger.Info("Background delete resumed: the NFS server answered", "waited", time.Since(start).Round(time.Second))
		}
	}()
	if e.beforeStep != nil {
		e.beforeStep() // in tests, a step the server is slow to answer
	}
	if err := e.bg.Err(); err != nil {
		return fmt.Errorf("stopped for shutdown: %w", err)
	}
	return fn()
}

// PendingDeletes counts the volumes moved to the trash and not yet removed.
func (e *Exports) PendingDeletes() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.pending
}
