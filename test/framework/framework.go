// Package framework holds what dirpv's integration, e2e and bench programs share: building the
// dirpv binary, running it as a real process, and waiting for cluster state with deadlines.
package framework

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/dirpv/dirpv/test/image"
)

// RepoRoot is the module's root directory, found from this source file.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

var (
	buildOnce sync.Once
	buildPath string
	buildErr  error
)

// BuildDirpv builds cmd/dirpv once per process into dir and returns the binary's path. It is
// built as it ships (image.DirpvBuildArgs): what the tests and the bench run, and measure, is
// the released binary.
func BuildDirpv(ctx context.Context, dir string) (string, error) {
	buildOnce.Do(func() {
		out := filepath.Join(dir, "dirpv")
		cmd := exec.CommandContext(ctx, "go", append(image.DirpvBuildArgs("dev"), "-o", out, "./cmd/dirpv")...)
		cmd.Dir = RepoRoot()
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build ./cmd/dirpv: %w\n%s", err, b)
			return
		}
		buildPath = out
	})
	return buildPath, buildErr
}

// Process is a dirpv (or other) process started by a test.
type Process struct {
	Name string
	Args []string
	Log  string
	// HTTPAddr is where a dirpv process serves /healthz and /metrics (StartDirpv).
	HTTPAddr string
	// Env is added to the test's environment at every start, Restart included: set it
	// between a Kill and a Restart to start the same process differently (a failpoint armed).
	Env []string
	// baseEnv comes before Env, at every start (StartEnv).
	baseEnv []string
	cmd     *exec.Cmd
	done    chan struct{}
	err     error
}

// Start runs binary with args, logging to logDir/name.log (appended, so a restarted
// process keeps one log).
func Start(binary, name, logDir string, args ...string) (*Process, error) {
	return StartEnv(nil, binary, name, logDir, args...)
}

// StartEnv is Start with env added to the process's environment at every start, before Env.
func StartEnv(env []string, binary, name, logDir string, args ...string) (*Process, error) {
	p := &Process{Name: name, Args: args, Log: filepath.Join(logDir, name+".log"), baseEnv: env}
	return p, p.start(binary)
}

func (p *Process) start(binary string) error {
	f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("open log of %s: %w", p.Name, err)
	}
	fmt.Fprintf(f, "=== %s %s %s\n", time.Now().Format(time.RFC3339Nano), binary, strings.Join(p.Args, " "))
	cmd := exec.Command(binary, p.Args...)
	if env := append(slices.Clip(p.baseEnv), p.Env...); len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
		fmt.Fprintf(f, "=== environment: %s\n", strings.Join(env, " "))
	}
	cmd.Stdout, cmd.Stderr = f, f
	// Its own process group, so that a test's Ctrl-C does not race with our shutdown.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	p.cmd, p.done = cmd, make(chan struct{})
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return nil
}

// Restart starts the process again with the same binary and arguments; it must have exited.
func (p *Process) Restart() error {
	select {
	case <-p.done:
	default:
		return fmt.Errorf("%s is still running", p.Name)
	}
	return p.start(p.cmd.Path)
}

// Pid is the process's ID, e.g. to reach its mount namespace through /proc/<pid>/root.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Kill sends SIGKILL, like a crash or an OOM kill, and waits for the process to exit.
func (p *Process) Kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Terminate sends SIGTERM, as kubelet does to a pod being replaced, and returns without
// waiting; Exited tells when the process has gone and how.
func (p *Process) Terminate() {
	p.cmd.Process.Signal(syscall.SIGTERM)
}

// Stop sends SIGTERM and waits up to timeout before killing it; it reports whether the process
// exited by itself.
func (p *Process) Stop(timeout time.Duration) bool {
	select {
	case <-p.done:
		return true
	default:
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		p.Kill()
		return false
	}
}

// Exited reports whether the process has exited, and its error.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.err
	default:
		return false, nil
	}
}

// Tail returns the last n bytes of the process's log, for failure messages.
func (p *Process) Tail(n int) string {
	b, _ := os.ReadFile(p.Log)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// Poll calls cond every interval until it returns true or an error, or timeout passes; the
// returned error then includes cond's last complaint, so a failing test says what it waited for.
func Poll(ctx context.Context, timeout time.Duration, cond func(ctx context.Context) (bool, error)) error {
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		ok, err := cond(ctx)
		// A call cut short by the deadline, or refused by the client's rate limiter because it
		// would wait past it, says nothing about what we waited for: keep the complaint from
		// before.
		if err != nil && ctx.Err() == nil && !strings.Contains(err.Error(), "would exceed context deadline") {
			last = err
		}
		return ok, nil
	})
	if err != nil && last != nil {
		return fmt.Errorf("%w; last error: %v", err, last)
	}
	return err
}

// WaitForPVCBound waits until the claim is Bound and returns it.
func WaitForPVCBound(ctx context.Context, c kubernetes.Interface, ns, name string, timeout time.Duration) (*v1.PersistentVolumeClaim, error) {
	var pvc *v1.PersistentVolumeClaim
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		pvc, err = c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return pvc.Status.Phase == v1.ClaimBound, fmt.Errorf("claim %s/%s is %s", ns, name, pvc.Status.Phase)
	})
	if err != nil {
		return nil, fmt.Errorf("wait for claim %s/%s to be Bound: %w", ns, name, err)
	}
	return pvc, nil
}

// WaitForEvent waits for an event on the object whose reason is reason and whose message
// contains substr, and returns it.
func WaitForEvent(ctx context.Context, c kubernetes.Interface, ns, kind, name, reason, substr string, timeout time.Duration) (*v1.Event, error) {
	var found *v1.Event
	sel := fields.Set{"involvedObject.kind": kind, "involvedObject.name": name}.AsSelector().String()
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil {
			return false, err
		}
		var seen bytes.Buffer
		for i, e := range evs.Items {
			if e.Reason == reason && strings.Contains(e.Message, substr) {
				found = &evs.Items[i]
				return true, nil
			}
			fmt.Fprintf(&seen, "[%s: %s] ", e.Reason, e.Message)
		}
		return false, fmt.Errorf("events so far: %s", seen.String())
	})
	if err != nil {
		return nil, fmt.Errorf("wait for %s event mentioning %q on %s %s/%s: %w", reason, substr, kind, ns, name, err)
	}
	return found, nil
}

// WaitForBoundPV waits until the claim is Bound and returns its PV.
func WaitForBoundPV(ctx context.Context, c kubernetes.Interface, ns, name string, timeout time.Duration) (*v1.PersistentVolume, error) {
	pvc, err := WaitForPVCBound(ctx, c, ns, name, timeout)
	if err != nil {
		return nil, err
	}
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("PV of claim %s/%s: %w", ns, name, err)
	}
	return pv, nil
}

// WaitForClaimsBound waits until n claims in the namespace are Bound.
func WaitForClaimsBound(ctx context.Context, c kubernetes.Interface, ns string, n int, timeout time.Duration) error {
	return Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		bound, _, err := BoundClaims(ctx, c, ns)
		if err != nil {
			return false, err
		}
		return bound == n, fmt.Errorf("%d of %d claims in %s Bound", bound, n, ns)
	})
}

// WaitForDeleted waits until get answers NotFound. Any other error (a timeout, a refused
// connection) says nothing about whether the object is gone: it only becomes the complaint
// reported if the wait times out. While the object exists, get describes it (e.g. its phase)
// for that complaint.
func WaitForDeleted(ctx context.Context, timeout time.Duration, what string, get func(ctx context.Context) (string, error)) error {
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		state, err := get(ctx)
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, err
		}
		return false, fmt.Errorf("%s still exists: %s", what, state)
	})
	if err != nil {
		return fmt.Errorf("wait for %s to be deleted: %w", what, err)
	}
	return nil
}

// WaitForPVDeleted waits until the PV is gone, i.e. its provisioner finished Delete. If it is
// not, the error lists the PV's events (VolumeFailedDelete says why).
func WaitForPVDeleted(ctx context.Context, c kubernetes.Interface, name string, timeout time.Duration) error {
	err := WaitForDeleted(ctx, timeout, "PV "+name, func(ctx context.Context) (string, error) {
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		return string(pv.Status.Phase), nil
	})
	if err != nil {
		return fmt.Errorf("%w\nevents: %s", err, EventsOf(ctx, c, "", "PersistentVolume", name))
	}
	return nil
}

// EventsOf lists an object's events as "reason (xcount): message" lines, for failure messages.
func EventsOf(ctx context.Context, c kubernetes.Interface, ns, kind, name string) string {
	sel := fields.Set{"involvedObject.kind": kind, "involvedObject.name": name}.AsSelector().String()
	evs, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: sel})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, e := range evs.Items {
		fmt.Fprintf(&b, "\n  %s (x%d): %s", e.Reason, max(e.Count, 1), e.Message)
	}
	return b.String()
}

// WaitForPodDeleted waits until the pod object is gone.
func WaitForPodDeleted(ctx context.Context, c kubernetes.Interface, ns, name string, timeout time.Duration) error {
	return WaitForDeleted(ctx, timeout, "pod "+ns+"/"+name, func(ctx context.Context) (string, error) {
		p, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return "", err
		}
		return string(p.Status.Phase), nil
	})
}

// WaitForPodPhase waits until the pod is in phase and returns it. A pod that ended in the
// other final phase (Succeeded or Failed) will not get there: it returns an error at once.
func WaitForPodPhase(ctx context.Context, c kubernetes.Interface, ns, name string, phase v1.PodPhase, timeout time.Duration) (*v1.Pod, error) {
	var pod *v1.Pod
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		var err error
		if pod, err = c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return false, err
		}
		return pod.Status.Phase == phase || podEnded(pod), fmt.Errorf("pod %s/%s is %s: %+v", ns, name, pod.Status.Phase, pod.Status.ContainerStatuses)
	})
	if err == nil && pod.Status.Phase != phase {
		err = fmt.Errorf("it ended %s: %+v", pod.Status.Phase, pod.Status.ContainerStatuses)
	}
	if err != nil {
		return nil, fmt.Errorf("wait for pod %s/%s to be %s: %w", ns, name, phase, err)
	}
	return pod, nil
}

func podEnded(pod *v1.Pod) bool {
	return pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}
