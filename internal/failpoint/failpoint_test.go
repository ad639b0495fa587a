package failpoint

import (
	"context"
	"errors"
	"fmt"
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

// TestHelperHitAfter is the process TestHitAfterCounts starts: it reaches DuringCopy five
// times, saying so each time.
func TestHelperHitAfter(t *testing.T) {
	if os.Getenv(Env) == "" {
		t.Skip("run by TestHitAfterCounts")
	}
	for n := int64(1); n <= 5; n++ {
		fmt.Fprintf(os.Stderr, "entry %d\n", n)
		HitAfter(DuringCopy, n)
	}
	t.Fatal("the process lived on past its armed count")
}

// TestHitAfterCounts: armed with a count, a point dies the Nth time it is reached, not before.
func TestHitAfterCounts(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperHitAfter$", "-test.v")
	cmd.Env = append(os.Environ(), Env+"="+DuringCopy+":3")
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("process armed at %s:3: %v, want killed by SIGKILL\n%s", DuringCopy, err, out)
	}
	if s := string(out); !strings.Contains(s, "entry 3\n") || strings.Contains(s, "entry 4") {
		t.Errorf("the process did not die at the third entry:\n%s", out)
	}
}

// TestHelperPause is the process TestPauseWaitsForCancel starts: it reaches PauseDuringCopy
// twice, the second time (the armed count) with its work cancelled by another goroutine once
// the pause began.
func TestHelperPause(t *testing.T) {
	if os.Getenv(Env) == "" {
		t.Skip("run by TestPauseWaitsForCancel")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	PauseAt(ctx, PauseDuringCopy, 1) // not the armed count: returns
	fmt.Fprintln(os.Stderr, "entry 1 passed")
	go func() {
		<-paused
		cancel()
	}()
	PauseAt(ctx, PauseDuringCopy, 2)
	fmt.Fprintln(os.Stderr, "entry 2 passed")
}

// TestPauseWaitsForCancel: a pause point armed with a count holds the job at that count until
// the job's context is done, says so, and kills nothing; unarmed it does nothing.
func TestPauseWaitsForCancel(t *testing.T) {
	PauseAt(context.Background(), PauseDuringCopy, 1) // unarmed here: returns
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperPause$", "-test.v")
	cmd.Env = append(os.Environ(), Env+"="+PauseDuringCopy+":2")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("paused process: %v\n%s", err, out)
	}
	want := []string{"entry 1 passed", "failpoint " + PauseDuringCopy + " reached", "failpoint " + PauseDuringCopy + " released: context canceled", "entry 2 passed"}
	last := -1
	for _, w := range want {
		i := strings.Index(string(out), w)
		if i <= last {
			t.Fatalf("output lacks %q in order %q:\n%s", w, want, out)
		}
		last = i
	}
}
