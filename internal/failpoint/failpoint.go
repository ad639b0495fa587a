// Package failpoint lets a test make a dirpv process die at a named point of its work, as a
// crash or an OOM kill would, so that the test knows exactly what the dead process left behind
// and can check what a restart does with it. A window of a few microseconds is never hit
// reliably by killing the process from outside. A test that runs dirpv's code in its own
// process can also hold one goroutine at a racy point while another goes on (Reach).
//
// A point is armed by starting the process with DIRPV_TEST_FAILPOINT set to its name, or, for a
// point reached once per item of a long job (DuringCopy), to its name, a colon and a count N:
// the process dies the Nth time it gets there (HitAfter). A pause point (PauseDuringCopy)
// does not kill: the job stops there until it is cancelled (PauseAt), so that a test knows the
// job was under way when it did what is to cancel it. Nothing else changes the behaviour:
// unset (as in every deployment), Hit, HitAfter and PauseAt do nothing.
package failpoint

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Env names the environment variable that arms one failpoint.
const Env = "DIRPV_TEST_FAILPOINT"

// ReleaseEnv names the environment variable that gives a pause point a way out other than
// cancellation: a path whose appearance lets the paused job go on as if it had never stopped.
// A test then knows the job was still under way at every step it took before creating it.
const ReleaseEnv = "DIRPV_TEST_FAILPOINT_RELEASE"

// The points in dirpv's code.
const (
	// BeforeLimit is after a limited volume's directory was made under its temporary name
	// (a btrfs subvolume, or a plain directory for project quotas) and before its limit is set.
	BeforeLimit = "before-limit"
	// BeforeRename is after the temporary directory got its limit and marker, before it is
	// renamed into place.
	BeforeRename = "before-rename"
	// RenameClaimed is in a rename into place without replacing on NFS, which has no
	// RENAME_NOREPLACE: after the empty placeholder claimed the new name and before the
	// rename replaces it (volume.Root.renameNoReplace), for volumes, snapshots, archive and
	// trash alike.
	RenameClaimed = "rename-claimed"
	// DuringCopy is in the copy of a tree into a new volume (volume.Root.MkdirAllFrom), once
	// per entry copied, before the volume is renamed into place. Armed as "during-copy:N",
	// the process dies after copying N entries, leaving a half-made copy under the volume's
	// temporary name; armed without a count it dies at the first entry.
	DuringCopy = "during-copy"
	// PauseDuringCopy is where DuringCopy is; armed as "pause-during-copy:N", a copy stops
	// after copying N entries until its context is done, leaving a half-made copy under the
	// volume's temporary name for as long as it is not cancelled.
	PauseDuringCopy = "pause-during-copy"
)

// armed and armedCount are read once: a process is started with the point it is to die at.
var (
	armed, armedCount = parse(os.Getenv(Env))
	releasePath       = os.Getenv(ReleaseEnv)
)

// parse splits "name" or "name:N".
func parse(v string) (string, int64) {
	name, count, ok := strings.Cut(v, ":")
	if !ok {
		return v, 1
	}
	n, err := strconv.ParseInt(count, 10, 64)
	if err != nil || n < 1 {
		// A typo must not leave the test believing it armed something.
		fmt.Fprintf(os.Stderr, "failpoint: %s=%q: the count must be a positive integer\n", Env, v)
		os.Exit(2)
	}
	return name, n
}

// paused is closed when PauseAt first begins to wait, for this package's test.
var (
	paused     = make(chan struct{})
	pausedOnce sync.Once
)

// PauseAt waits until ctx is done, or the ReleaseEnv path exists, if name is the armed point
// and n, the times it was reached so far in this job, is the armed count; it says on stderr
// that it paused, and why it went on, for the test to read in the process's log.
func PauseAt(ctx context.Context, name string, n int64) {
	if armed == "" || armed != name || n != armedCount {
		return
	}
	fmt.Fprintf(os.Stderr, "failpoint %s reached: pausing until the job is cancelled (%s=%s)\n", name, Env, armed)
	pausedOnce.Do(func() { close(paused) })
	// A test's own process, never a deployment: polling a path is simpler than a signal handler.
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			fmt.Fprintf(os.Stderr, "failpoint %s released: %v\n", name, ctx.Err())
			return
		case <-tick.C:
			if releasePath == "" {
				continue
			}
			if _, err := os.Lstat(releasePath); err == nil {
				fmt.Fprintf(os.Stderr, "failpoint %s released: %s exists\n", name, releasePath)
				return
			}
		}
	}
}

// Hit kills the process with SIGKILL if name is the armed point, after saying so on stderr
// (the test reads it in the process's log to know the process died there and nowhere else).
func Hit(name string) { HitAfter(name, 1) }

// HitAfter is Hit for a point reached once per item: n counts the times it was reached so far,
// this one included, and the process dies when n reaches the armed count (1 without one).
func HitAfter(name string, n int64) {
	if armed == "" || armed != name || n < armedCount {
		return
	}
	fmt.Fprintf(os.Stderr, "failpoint %s reached: killing the process (%s=%s)\n", name, Env, armed)
	_ = unix.Kill(os.Getpid(), unix.SIGKILL)
	// The signal is delivered before the process runs on; nothing after this point may run.
	select {}
}

// Points where a test that runs dirpv's code in its own process holds one side of a race
// (SetOnReach), to prove that the other side waits. The environment never arms them.
const (
	// DeleteChecked is in Delete, after the volume directory's owner was checked and before
	// the directory is removed, archived or moved to an NFS export's trash.
	DeleteChecked = "delete-checked"
	// ResizeChecked is in Resize, after the volume's marker named its quota ID and before the
	// limit of that ID is raised.
	ResizeChecked = "resize-checked"
	// CopyStarted is in a copy of a tree (a clone's, a restore's, a snapshot's) that is not a
	// btrfs snapshot, once its target is made and before its first entry is copied: where
	// it holds whatever caps how many copies run at once.
	CopyStarted = "copy-started"
)

var onReach atomic.Pointer[func(string)]

// Reach calls the function installed by SetOnReach with name; without one it does nothing.
func Reach(name string) {
	if fn := onReach.Load(); fn != nil {
		(*fn)(name)
	}
}

// SetOnReach makes Reach call fn until restore is called. fn runs on the goroutine that
// reached the point, so it holds that goroutine for as long as it blocks.
func SetOnReach(fn func(name string)) (restore func()) {
	onReach.Store(&fn)
	return func() { onReach.Store(nil) }
}
