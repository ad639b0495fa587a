package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/vm"
)

// The bench's guest-side measurements (make bench, test/bench): what takes a program in the
// guest, because it goes through the guest's kernel NFS client or dials the node plugin's CSI
// socket, which only the guest has. The host hands a BenchRequest to a copy of this binary
// run in the guest (Node.Bench), which answers with a BenchResult.

// benchEnv, set in the guest, names the request file of a bench run.
const benchEnv = "DIRPV_VM_NODE_BENCH"

// CSISocket is the node plugin's CSI socket in the guest (deploy/'s kubelet root dir).
const CSISocket = "/var/lib/kubelet/plugins/dirpv.io/csi.sock"

// BenchRequest says what to measure in the guest.
type BenchRequest struct {
	// Source and Options are an NFS mount's source (server:path) and options: what the
	// floors mount, with mount(8) through mount-utils, as kubelet and CSI drivers do.
	Source  string   `json:"source"`
	Options []string `json:"options"`
	// Dirs > 0 measures the storage floor of provisioning and deleting: Source mounted once,
	// Dirs directories made in it and then removed, benchkit.Parallelism at a time.
	Dirs int `json:"dirs,omitempty"`
	// Publish > 0 measures Publish rounds of NodePublishVolume+NodeUnpublishVolume of
	// VolumeID through CSISocket, each round followed by as many bare mount+umount of Source.
	Publish  int    `json:"publish,omitempty"`
	Rounds   int    `json:"rounds,omitempty"`
	VolumeID string `json:"volumeID,omitempty"`
	// IdealProvisioner, if set, runs benchkit's ideal external provisioner of that name
	// instead (StartIdeal), with Source as its export and IdealKubeconfig, an admin's
	// kubeconfig in the guest (the VM's share), as its client.
	IdealProvisioner string `json:"idealProvisioner,omitempty"`
	IdealKubeconfig  string `json:"idealKubeconfig,omitempty"`
	// PodUID is a running pod's on the node: the targets go in its directory below kubelet's
	// pods directory, where the node plugin sees them and kubelet leaves them alone.
	PodUID string            `json:"podUID,omitempty"`
	Attrs  map[string]string `json:"attrs,omitempty"`
}

// BenchResult is what the guest measured.
type BenchResult struct {
	Mkdir, Rmdir time.Duration
	// Publish are the NodePublish+NodeUnpublish times, Mount the bare mount+umount times.
	Publish, Mount []time.Duration
	Error          string
}

// Bench runs req in the guest and returns what it measured. timeout bounds it in the guest.
func (n *Node) Bench(ctx context.Context, timeout time.Duration, req BenchRequest) (*BenchResult, error) {
	run, err := n.startBench(ctx, timeout, req)
	if err != nil {
		return nil, err
	}
	defer run.cleanup()
	if err := <-run.done; err != nil {
		return nil, err
	}
	return run.result()
}

// StartIdeal starts the ideal external provisioner of req.IdealProvisioner in the guest, with
// Source mounted by mount-utils as its export, and returns once it serves: benchkit.StartIdeal,
// with a directory on the export, made through the kernel client, for each claim it is
// handed, removed when its PV is Released. stop ends it. While it runs, the node serves no
// other request (Exec, Bench, ...).
func (n *Node) StartIdeal(ctx context.Context, req BenchRequest, adminKubeconfig string) (stop func() error, err error) {
	kc := "ideal-" + strconv.FormatInt(controlSeq.Add(1), 10) + ".kubeconfig"
	if err := copyFile(adminKubeconfig, filepath.Join(n.Machine.Share(), kc), 0o600); err != nil {
		return nil, err
	}
	req.IdealKubeconfig = filepath.Join(vm.GuestShareDir, kc)
	run, err := n.startBench(ctx, time.Hour, req)
	if err != nil {
		os.Remove(filepath.Join(n.Machine.Share(), kc))
		return nil, err
	}
	run.files = append(run.files, filepath.Join(n.Machine.Share(), kc))
	stop = func() error {
		defer run.cleanup()
		if err := writeRenamed(run.req+".stop", nil); err != nil {
			return err
		}
		if err := <-run.done; err != nil {
			return err
		}
		_, err := run.result()
		return err
	}
	if err := waitReady(ctx, run.req+".ready", run.done); err != nil {
		return nil, fmt.Errorf("node: ideal provisioner in the guest: %w", errors.Join(err, stop()))
	}
	return stop, nil
}

// benchRun is a bench request running in the guest: its request file, done once the guest's
// side has ended, and the files to remove after it.
type benchRun struct {
	req   string
	done  chan error
	files []string
}

// startBench writes req to the VM's share and runs the agent's copy of this binary on it in
// the guest (benchMain), which the guest sees at the same path (Start).
func (n *Node) startBench(ctx context.Context, timeout time.Duration, req BenchRequest) (*benchRun, error) {
	name := "bench-" + strconv.FormatInt(controlSeq.Add(1), 10) + ".json"
	run := &benchRun{req: filepath.Join(n.Machine.Share(), name), done: make(chan error, 1)}
	for _, ext := range []string{"", ".out", ".ready", ".stop"} {
		run.files = append(run.files, run.req+ext)
	}
	b, err := json.Marshal(req)
	if err == nil {
		err = writeRenamed(run.req, b)
	}
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	go func() {
		out, err := n.Exec(ctx, timeout, "env", benchEnv+"="+filepath.Join(vm.GuestShareDir, name), filepath.Join(n.dir, "agent"))
		if err != nil {
			err = fmt.Errorf("%w: %s", err, out)
		}
		run.done <- err
	}()
	return run, nil
}

func (r *benchRun) cleanup() {
	for _, f := range r.files {
		os.Remove(f)
	}
}

// result reads what the guest's side wrote.
func (r *benchRun) result() (*BenchResult, error) {
	var res BenchResult
	b, err := os.ReadFile(r.req + ".out")
	if err == nil {
		err = json.Unmarshal(b, &res)
	}
	if err == nil && res.Error != "" {
		err = errors.New(res.Error)
	}
	if err != nil {
		return &res, fmt.Errorf("node: bench in the guest: %w", err)
	}
	return &res, nil
}

// waitReady waits, up to 5 minutes, until file exists, or until done says the guest's
// side has ended (it puts the error back for the caller).
func waitReady(ctx context.Context, file string, done chan error) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	tick := time.NewTicker(controlPoll)
	defer tick.Stop()
	for {
		if _, err := os.Stat(file); err == nil {
			return nil
		}
		select {
		case err := <-done:
			done <- err
			return fmt.Errorf("ended before it served: %v", err)
		case <-ctx.Done():
			return fmt.Errorf("not serving: %w", ctx.Err())
		case <-tick.C:
		}
	}
}

// benchMain is the guest's side of Bench: it runs the request in file reqPath and writes the
// result next to it.
func benchMain(reqPath string) int {
	var req BenchRequest
	b, err := os.ReadFile(reqPath)
	if err == nil {
		err = json.Unmarshal(b, &req)
	}
	res := &BenchResult{}
	if err == nil {
		err = runBench(context.Background(), req, res, reqPath)
	}
	if err != nil {
		res.Error = err.Error()
	}
	if b, err = json.Marshal(res); err == nil {
		err = writeRenamed(reqPath+".out", b)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		return 1
	}
	return 0
}

func runBench(ctx context.Context, req BenchRequest, res *BenchResult, reqPath string) (err error) {
	// The floor's mount point can be anywhere; the publish targets must be where the node
	// plugin's container sees them.
	parent := os.TempDir()
	if req.PodUID != "" {
		parent = filepath.Join("/var/lib/kubelet/pods", req.PodUID)
	}
	work, err := os.MkdirTemp(parent, "dirpv-bench-")
	if err != nil {
		return err
	}
	// Not RemoveAll: a mount left below would have its files removed; the empty directories
	// go, last first.
	defer func() {
		for _, d := range []string{"csi/mount", "csi", "bare", "export", ""} {
			_ = os.Remove(filepath.Join(work, d))
		}
	}()
	mounter := mount.New("")
	export := filepath.Join(work, "export")
	if req.IdealProvisioner != "" || req.Dirs > 0 {
		if err := os.MkdirAll(export, 0o755); err != nil {
			return err
		}
		if err := mounter.Mount(req.Source, export, "nfs", req.Options); err != nil {
			return err
		}
		defer func() {
			if uerr := mounter.Unmount(export); uerr != nil && err == nil {
				err = uerr
			}
		}()
	}
	switch {
	case req.IdealProvisioner != "":
		return runIdeal(ctx, req, export, reqPath)
	case req.Dirs > 0:
		res.Mkdir, res.Rmdir, err = dirsFloor(req.Dirs, export)
		return err
	case req.Publish > 0:
		if req.PodUID == "" {
			return errors.New("publish: no pod UID for the targets")
		}
		return publishRounds(ctx, mounter, req, work, res)
	}
	return nil
}

// runIdeal is the guest's side of StartIdeal: it serves until the host writes reqPath.stop,
// having written reqPath.ready once it serves.
func runIdeal(ctx context.Context, req BenchRequest, export, reqPath string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", req.IdealKubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 5000, 10000
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	stop, err := benchkit.StartIdeal(ctx, cs, req.IdealProvisioner, export)
	if err != nil {
		return err
	}
	if err := writeRenamed(reqPath+".ready", nil); err != nil {
		return errors.Join(err, stop())
	}
	// The host's stop, or the end of the longest bench run.
	for deadline := time.Now().Add(time.Hour); time.Now().Before(deadline); time.Sleep(controlPoll) {
		if _, err := os.Stat(reqPath + ".stop"); err == nil {
			return stop()
		}
	}
	return errors.Join(errors.New("ideal provisioner: the host never asked it to stop"), stop())
}

// dirsFloor makes n directories in the mounted export, benchkit.Parallelism at a time, then
// removes them, and returns how long each half took: what any provisioner on this export must
// do at least.
func dirsFloor(n int, export string) (mkdir, rmdir time.Duration, err error) {
	parent, err := os.MkdirTemp(export, "dirpv-bench-floor-")
	if err != nil {
		return 0, 0, err
	}
	defer os.Remove(parent)
	each := func(fn func(string) error) (time.Duration, error) {
		t0 := time.Now()
		err := benchkit.Parallel(n, benchkit.Parallelism, func(i int) error {
			return fn(filepath.Join(parent, strconv.Itoa(i)))
		})
		return time.Since(t0), err
	}
	if mkdir, err = each(func(p string) error { return os.Mkdir(p, 0o777) }); err != nil {
		return 0, 0, err
	}
	rmdir, err = each(os.Remove)
	return mkdir, rmdir, err
}

// publishRounds alternates rounds of dirpv's NodePublish+NodeUnpublish with rounds of bare
// mounts of the same source (benchkit.Rounds).
func publishRounds(ctx context.Context, mounter mount.Interface, req BenchRequest, work string, res *BenchResult) error {
	// kubelet makes the target's parent; the plugin makes the target.
	target := filepath.Join(work, "csi", "mount")
	bare := filepath.Join(work, "bare")
	for _, d := range []string{filepath.Dir(target), bare} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}
	p, err := benchkit.DialPublisher(CSISocket, &csi.NodePublishVolumeRequest{
		VolumeId: req.VolumeID, TargetPath: target, VolumeContext: req.Attrs,
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: req.Options}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		}})
	if err != nil {
		return err
	}
	defer p.Close()
	ds, err := benchkit.Rounds(req.Rounds, req.Publish/max(1, req.Rounds),
		func() error { return p.Cycle(ctx) },
		func() error {
			if err := mounter.Mount(req.Source, bare, "nfs", req.Options); err != nil {
				return err
			}
			return mounter.Unmount(bare)
		})
	if err != nil {
		return err
	}
	res.Publish, res.Mount = ds[0], ds[1]
	return nil
}
