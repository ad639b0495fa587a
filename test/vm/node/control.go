package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm"
	"github.com/dirpv/dirpv/test/vm/guest"
)

// The host's requests to the node agent travel as files in the VM's share (vm.Machine.Share),
// which both sides see while the guest runs: the host writes controlDir/<n>.req, the agent
// runs it and answers with <n>.resp. Each file is written under another name and renamed, so
// that neither side reads half of one. This is how a test plays the server's administrator
// (stop nfsd, look at the exported directory) without a pod, which costs tens of seconds
// under emulation, and without a network path into the guest.
const controlDir = "control"

// controlPoll is how often the agent looks for requests and the host for answers.
const controlPoll = 100 * time.Millisecond

// Request kinds.
const (
	opStopNFS  = "stop-nfs"
	opStartNFS = "start-nfs"
	opExec     = "exec"
)

type controlRequest struct {
	Op string `json:"op"`
	// Args is the command line of opExec.
	Args []string `json:"args,omitempty"`
	// Timeout bounds the request in the guest.
	Timeout time.Duration `json:"timeout"`
}

type controlResponse struct {
	Output string `json:"output"`
	Error  string `json:"error,omitempty"`
}

var controlSeq atomic.Int64

// StopNFS stops every nfsd thread of the guest's NFS server (Options.NFS), as if the server
// had died: mounts of it hang (hard) or fail (soft) until StartNFS.
func (n *Node) StopNFS(ctx context.Context) error {
	_, err := n.control(ctx, controlRequest{Op: opStopNFS, Timeout: time.Minute})
	return err
}

// StartNFS starts the guest's nfsd threads again and returns once NFSv3 and NFSv4 answer.
func (n *Node) StartNFS(ctx context.Context) error {
	_, err := n.control(ctx, controlRequest{Op: opStartNFS, Timeout: 2 * time.Minute})
	return err
}

// Exec runs a command in the guest, outside any pod (as root, in the guest's own namespaces:
// what the NFS server's administrator sees), and returns its output; an exit status other
// than 0 is an error holding the output. timeout bounds it in the guest.
func (n *Node) Exec(ctx context.Context, timeout time.Duration, args ...string) (string, error) {
	return n.control(ctx, controlRequest{Op: opExec, Args: args, Timeout: timeout})
}

// control hands req to the agent and waits for its answer: up to req.Timeout plus the time
// the agent may take to notice the request under emulation.
func (n *Node) control(ctx context.Context, req controlRequest) (string, error) {
	dir := filepath.Join(n.Machine.Share(), controlDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("node: %w", err)
	}
	id := strconv.FormatInt(controlSeq.Add(1), 10)
	b, err := json.Marshal(req)
	if err != nil {
		return "", fmt.Errorf("node: %w", err)
	}
	if err := writeRenamed(filepath.Join(dir, id+".req"), b); err != nil {
		return "", err
	}
	respPath := filepath.Join(dir, id+".resp")
	var resp controlResponse
	err = framework.Poll(ctx, req.Timeout+30*time.Second, func(context.Context) (bool, error) {
		select {
		case <-n.Machine.Done():
			return false, errors.New("the guest is gone")
		default:
		}
		b, err := os.ReadFile(respPath)
		if err != nil {
			return false, err
		}
		return true, json.Unmarshal(b, &resp)
	})
	if err != nil {
		return "", fmt.Errorf("node: %s %s in the guest: no answer: %w", req.Op, strings.Join(req.Args, " "), err)
	}
	if resp.Error != "" {
		return resp.Output, fmt.Errorf("node: %s %s in the guest: %s", req.Op, strings.Join(req.Args, " "), resp.Error)
	}
	return resp.Output, nil
}

func writeRenamed(path string, b []byte) error {
	if err := os.WriteFile(path+".tmp", b, 0o644); err != nil {
		return fmt.Errorf("node: %w", err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return fmt.Errorf("node: %w", err)
	}
	return nil
}

// serveControl is the agent's side: it answers the host's requests, one at a time, until ctx
// ends. srv is the guest's NFS server, nil without Options.NFS.
func serveControl(ctx context.Context, srv *guest.NFSServer, logf func(string, ...any)) {
	dir := filepath.Join(vm.GuestShareDir, controlDir)
	tick := time.NewTicker(controlPoll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		reqs, _ := filepath.Glob(filepath.Join(dir, "*.req"))
		for _, p := range reqs {
			resp := runControl(ctx, srv, p)
			if resp.Error != "" {
				logf("control %s: %s", filepath.Base(p), resp.Error)
			}
			b, _ := json.Marshal(resp)
			// The request goes once answered: a later scan must not run it again.
			if err := writeRenamed(strings.TrimSuffix(p, ".req")+".resp", b); err != nil {
				logf("control %s: %v", filepath.Base(p), err)
			}
			if err := os.Remove(p); err != nil {
				logf("control %s: %v", filepath.Base(p), err)
			}
		}
	}
}

func runControl(ctx context.Context, srv *guest.NFSServer, path string) controlResponse {
	var req controlRequest
	b, err := os.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(b, &req)
	}
	if err != nil {
		return controlResponse{Error: err.Error()}
	}
	ctx, cancel := context.WithTimeout(ctx, req.Timeout)
	defer cancel()
	switch req.Op {
	case opStopNFS, opStartNFS:
		if srv == nil {
			return controlResponse{Error: "the guest runs no NFS server (Options.NFS)"}
		}
		if req.Op == opStopNFS {
			err = srv.Kill(ctx)
		} else {
			err = srv.Resume(ctx)
		}
	case opExec:
		if len(req.Args) == 0 {
			return controlResponse{Error: "no command"}
		}
		out, err := exec.CommandContext(ctx, req.Args[0], req.Args[1:]...).CombinedOutput()
		resp := controlResponse{Output: string(out)}
		if err != nil {
			resp.Error = err.Error()
		}
		return resp
	default:
		err = fmt.Errorf("unknown request %q", req.Op)
	}
	if err != nil {
		return controlResponse{Error: err.Error()}
	}
	return controlResponse{}
}

// guestContainerd is the socket of the guest's containerd (cluster.StartNode in agentWorkDir).
var guestContainerd = filepath.Join(agentWorkDir, "containerd", "containerd.sock")

// ImportImage imports an image tar into the guest's containerd, for pods whose images are
// made after the node started (Options.Images are imported as it starts). The tar is copied
// into the VM's share, which the guest sees at vm.GuestShareDir.
func (n *Node) ImportImage(ctx context.Context, tarPath string) error {
	name := "import-" + strconv.FormatInt(controlSeq.Add(1), 10) + ".tar"
	if err := copyFile(tarPath, filepath.Join(n.Machine.Share(), name), 0o644); err != nil {
		return err
	}
	defer os.Remove(filepath.Join(n.Machine.Share(), name))
	_, err := n.Exec(ctx, 5*time.Minute, "ctr", "--address", guestContainerd, "-n", "k8s.io",
		"images", "import", filepath.Join(vm.GuestShareDir, name))
	return err
}

// TagImage gives an image in the guest's containerd another name.
func (n *Node) TagImage(ctx context.Context, src, dst string) error {
	_, err := n.Exec(ctx, time.Minute, "ctr", "--address", guestContainerd, "-n", "k8s.io",
		"images", "tag", "--force", src, dst)
	return err
}
