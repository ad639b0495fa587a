// Package failpoint lets a test make a dirpv process die at a named point of its work, as a
// crash or an OOM kill would, so that the test knows exactly what the dead process left behind
// and can check what a restart does with it. A window of a few microseconds is never hit
// reliably by killing the process from outside.
//
// A point is armed by starting the process with DIRPV_TEST_FAILPOINT set to its name. Nothing
// else changes the behaviour: unset (as in every deployment), Hit does nothing.
package failpoint

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Env names the environment variable that arms one failpoint.
const Env = "DIRPV_TEST_FAILPOINT"

// The points in dirpv's code.
const (
	// BeforeLimit is after a limited volume's directory was made under its temporary name
	// (a btrfs subvolume, or a plain directory for project quotas) and before its limit is set.
	BeforeLimit = "before-limit"
	// BeforeRename is after the temporary directory got its limit and marker, before it is
	// renamed into place.
	BeforeRename = "before-rename"
)

// armed is read once: a process is started with the point it is to die at.
var armed = os.Getenv(Env)

// Hit kills the process with SIGKILL if name is the armed point, after saying so on stderr
// (the test reads it in the process's log to know the process died there and nowhere else).
func Hit(name string) {
	if armed == "" || armed != name {
		return
	}
	fmt.Fprintf(os.Stderr, "failpoint %s reached: killing the process (%s=%s)\n", name, Env, armed)
	_ = unix.Kill(os.Getpid(), unix.SIGKILL)
	// The signal is delivered before the process runs on; nothing after this point may run.
	select {}
}
