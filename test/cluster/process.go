package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
)

// Proc is a child process of the cluster. StartTime (clock ticks since boot, from
// /proc/<pid>/stat) guards against signalling a recycled PID when the cluster is stopped from a
// state file by another process (`dirpv-cluster down`).
type Proc struct {
	Name      string `json:"name"`
	PID       int    `json:"pid"`
	StartTime uint64 `json:"startTime"`
	Log       string `json:"log"`

	// exited is closed once the process has been reaped; nil for processes loaded from a state
	// file (those are not our children).
	exited chan struct{}
}

// startProc starts bin with args, stdout+stderr appended to logDir/<name>.log. The child gets
// its own process group (Setpgid) so it survives the CLI that started it and does not receive
// the terminal's Ctrl-C; Stop signals it explicitly.
func startProc(logDir, workDir, name, bin string, args, env []string, extra []*os.File) (*Proc, error) {
	logPath := filepath.Join(logDir, name+".log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open log for %s: %w", name, err)
	}
	defer logf.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer devnull.Close()
	cmd := exec.Command(bin, args...)
	cmd.Dir = workDir
	cmd.Stdin, cmd.Stdout, cmd.Stderr = devnull, logf, logf
	cmd.Env = append(os.Environ(), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.ExtraFiles = extra
	fmt.Fprintf(logf, "=== %s %s %s\n", time.Now().Format(time.RFC3339), bin, strings.Join(args, " "))
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s (%s): %w", name, bin, err)
	}
	p := &Proc{Name: name, PID: cmd.Process.Pid, Log: logPath, exited: make(chan struct{})}
	p.StartTime, _ = procStartTime(p.PID)
	go func() {
		_ = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// alive reports whether the process still runs and is the one we started.
func (p *Proc) alive() bool {
	if p.exited != nil {
		select {
		case <-p.exited:
			return false
		default:
		}
	}
	st, err := procStartTime(p.PID)
	if err != nil {
		return false
	}
	return p.StartTime == 0 || st == p.StartTime
}

// stop sends SIGTERM, waits up to grace, then SIGKILLs and waits again. It signals the PID only
// (not the group): children such as containerd shims are handled by the caller explicitly.
func (p *Proc) stop(grace time.Duration) error {
	if !p.alive() {
		return nil
	}
	_ = syscall.Kill(p.PID, syscall.SIGTERM)
	if p.waitGone(grace) {
		return nil
	}
	_ = syscall.Kill(p.PID, syscall.SIGKILL)
	if p.waitGone(10 * time.Second) {
		return nil
	}
	return fmt.Errorf("%s (pid %d) did not exit after SIGKILL", p.Name, p.PID)
}

func (p *Proc) waitGone(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if !p.alive() {
			return true
		}
		if p.exited != nil {
			select {
			case <-p.exited:
				return true
			case <-time.After(50 * time.Millisecond):
			}
		} else {
			time.Sleep(50 * time.Millisecond)
		}
	}
	return !p.alive()
}

// procStartTime returns the start time of the process (/proc/<pid>/stat), or an error if it is
// gone or a zombie.
func procStartTime(pid int) (uint64, error) {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return 0, err
	}
	st, err := p.Stat()
	if err != nil {
		return 0, err
	}
	if st.State == "Z" || st.State == "X" {
		return 0, errors.New("zombie")
	}
	return st.Starttime, nil
}

// logTail returns the last n lines of a log file, for error messages.
func logTail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return tail(string(b), n)
}

// poll calls check every interval until it returns true, ctx ends or timeout passes, and
// reports check's last error. Every wait in this package goes through here, so every wait has a
// deadline. If p is not nil, its death aborts the wait early with its log tail.
func poll(ctx context.Context, timeout, interval time.Duration, what string, p *Proc, check func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var lastErr error
	for {
		ok, err := check(ctx)
		if ok {
			return nil
		}
		if err != nil {
			lastErr = err
		}
		if p != nil && !p.alive() {
			return fmt.Errorf("%s: %s exited; log %s:\n%s", what, p.Name, p.Log, logTail(p.Log, 30))
		}
		select {
		case <-ctx.Done():
			msg := fmt.Sprintf("%s: not done after %s", what, timeout)
			if lastErr != nil {
				msg += fmt.Sprintf(" (last error: %v)", lastErr)
			}
			if p != nil {
				msg += fmt.Sprintf("; log %s:\n%s", p.Log, logTail(p.Log, 30))
			}
			return errors.New(msg)
		case <-time.After(interval):
		}
	}
}
