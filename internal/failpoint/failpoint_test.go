package failpoint

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// TestHelperHit is the process TestHitKills starts: it hits BeforeLimit, then says it lived.
func TestHelperHit(t *testing.T) {
	if os.Getenv(Env) == "" {
		t.Skip("run by TestHitKills")
	}
	Hit(BeforeRename) // not the armed one: returns
	Hit(BeforeLimit)
	t.Fatal("the process lived on after its armed failpoint")
}

// TestHitKills: a process with a failpoint armed dies at it by SIGKILL, as a crash would, and
// says so; the other points, and every point when none is armed, do nothing.
func TestHitKills(t *testing.T) {
	Hit(BeforeLimit) // unarmed here
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHit$", "-test.v")
	cmd.Env = append(os.Environ(), Env+"="+BeforeLimit)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("process armed at %s: %v, want killed by SIGKILL\n%s", BeforeLimit, err, out)
	}
	if !strings.Contains(string(out), "failpoint "+BeforeLimit+" reached") {
		t.Errorf("the killed process did not say where it died:\n%s", out)
	}
}
