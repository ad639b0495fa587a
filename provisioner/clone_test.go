package provisioner

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// A copy that outlasts the inline wait goes on in the background: the first call gets no job,
// the job calls done once it ends, and the next call gets its result, once.
func TestCopyJobsBackground(t *testing.T) {
	j := newCopyJobs()
	j.inline = 10 * time.Millisecond
	release := make(chan struct{})
	noted := make(chan error, 1)
	fn := func(ctx context.Context) (made, error) {
		<-release
		return made{created: true}, nil
	}
	done := func(_ made, err error, _ time.Duration) { noted <- err }
	job, err := j.run(context.Background(), "uid", "src", time.Minute, fn, done)
	if job != nil || err != nil {
		t.Fatalf("first call: job %v, %v; want none while the copy runs", job, err)
	}
	// A second call while it runs starts nothing new.
	if job, err := j.run(context.Background(), "uid", "src", time.Minute, func(context.Context) (made, error) {
		t.Error("a second copy started for the same claim")
		return made{}, nil
	}, done); job != nil || err != nil {
		t.Fatalf("second call: job %v, %v", job, err)
	}
	close(release)
	select {
	case err := <-noted:
		if err != nil {
			t.Fatalf("done got %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("done was not called once the background copy ended")
	}
	job, err = j.run(context.Background(), "uid", "src", time.Minute, fn, done)
	if err != nil || job == nil || !job.result.created {
		t.Fatalf("call after the copy: job %+v, %v; want its result", job, err)
	}
	if len(j.byUID) != 0 {
		t.Errorf("jobs left after the result was taken: %v", j.byUID)
	}
	if !j.stop(time.Second) {
		t.Error("stop did not return in time")
	}
}

// A quick copy is returned by the call that starts it, and nobody is told again.
func TestCopyJobsInline(t *testing.T) {
	j := newCopyJobs()
	job, err := j.run(context.Background(), "uid", "src", time.Minute, func(context.Context) (made, error) {
		return made{quota: "btrfs/1"}, nil
	}, func(made, error, time.Duration) { t.Error("done called for a copy its caller waited for") })
	if err != nil || job == nil || job.result.quota != "btrfs/1" {
		t.Fatalf("job %+v, %v", job, err)
	}
	j.stop(time.Second)
}

// A copy past its deadline fails with an error naming --clone-timeout; stop cancels copies
// under way and refuses new ones.
func TestCopyJobsDeadlineAndStop(t *testing.T) {
	j := newCopyJobs()
	wait := func(ctx context.Context) (made, error) {
		<-ctx.Done()
		return made{}, ctx.Err()
	}
	job, err := j.run(context.Background(), "late", "src", 5*time.Millisecond, wait, func(made, error, time.Duration) {})
	if err != nil || job == nil || !errors.Is(job.err, context.DeadlineExceeded) || !strings.Contains(job.err.Error(), "--clone-timeout") {
		t.Fatalf("job %+v, %v; want a deadline error naming --clone-timeout", job, err)
	}
	j.inline = time.Millisecond
	if job, err := j.run(context.Background(), types.UID("long"), "src", time.Hour, wait, func(made, error, time.Duration) {}); job != nil || err != nil {
		t.Fatalf("long copy: job %v, %v", job, err)
	}
	if !j.stop(10 * time.Second) {
		t.Fatal("stop did not end the copy under way")
	}
	if _, err := j.run(context.Background(), "new", "src", time.Hour, wait, nil); !errors.Is(err, errCopyStopped) {
		t.Errorf("copy after stop: %v, want errCopyStopped", err)
	}
}
