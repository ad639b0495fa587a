package failpoint

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
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

// TestHelperPauseReleased is the process TestPauseReleasedByPath starts: it pauses at
// PauseDuringCopy with a context that is never cancelled.
func TestHelperPauseReleased(t *testing.T) {
	if os.Getenv(Env) == "" {
		t.Skip("run by TestPauseReleasedByPath")
	}
	PauseAt(context.Background(), PauseDuringCopy, 1)
	fmt.Fprintln(os.Stderr, "entry 1 passed")
}

// TestPauseReleasedByPath: a paused job goes on once the ReleaseEnv path exists, and not
// before: the process is still paused when the test creates the path.
func TestPauseReleasedByPath(t *testing.T) {
	release := filepath.Join(t.TempDir(), "release")
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperPauseReleased$", "-test.v")
	cmd.Env = append(os.Environ(), Env+"="+PauseDuringCopy, ReleaseEnv+"="+release)
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.After(time.Minute)
	for !strings.Contains(out.String(), "failpoint "+PauseDuringCopy+" reached") {
		select {
		case err := <-done:
			t.Fatalf("the process ended before it paused: %v\n%s", err, out.String())
		case <-deadline:
			t.Fatalf("the process did not pause:\n%s", out.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	if strings.Contains(out.String(), "entry 1 passed") {
		t.Fatalf("the job went on before its release:\n%s", out.String())
	}
	if err := os.WriteFile(release, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("released process: %v\n%s", err, out.String())
		}
	case <-deadline:
		cmd.Process.Kill()
		t.Fatalf("the process did not go on once %s existed:\n%s", release, out.String())
	}
	if s := out.String(); !strings.Contains(s, "released: "+release+" exists") || !strings.Contains(s, "entry 1 passed") {
		t.Errorf("the process did not say it was released by the path and go on:\n%s", s)
	}
}

// lockedBuffer is a bytes.Buffer that the process's output and the test share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
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
