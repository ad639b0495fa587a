package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/mount-utils"

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
	// Dirs directories made in it and then removed, Parallel at a time.
	Dirs     int `json:"dirs,omitempty"`
	Parallel int `json:"parallel,omitempty"`
	// Publish > 0 measures Publish rounds of NodePublishVolume+NodeUnpublishVolume of
	// VolumeID through CSISocket, each round followed by as many bare mount+umount of Source.
	Publish  int    `json:"publish,omitempty"`
	Rounds   int    `json:"rounds,omitempty"`
	VolumeID string `json:"volumeID,omitempty"`
	// Ideal, if set, runs the ideal external provisioner (StartIdeal) instead.
	Ideal *BenchIdeal `json:"ideal,omitempty"`
	// PodUID is a running pod's on the node: the targets go in its directory below kubelet's
	// pods directory, where the node plugin sees them and kubelet leaves them alone.
	PodUID string            `json:"podUID,omitempty"`
	Attrs  map[string]string `json:"attrs,omitempty"`
}

// BenchIdeal is the ideal external NFS provisioner in the guest: what any external provisioner
// on this export, dirpv included, can at best reach under the guest's emulation.
type BenchIdeal struct {
	// Provisioner is the name of the classes whose claims it serves.
	Provisioner string `json:"provisioner"`
	// Kubeconfig is an admin kubeconfig, in the guest (the VM's share).
	Kubeconfig string `json:"kubeconfig"`
	// Parallel is how many claims or volumes it serves at a time.
	Parallel int `json:"parallel"`
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
	// Request and result go through the VM's share, which both sides write; the agent's copy
	// of this binary the guest sees at the same path (Start).
	name := "bench-" + strconv.FormatInt(controlSeq.Add(1), 10) + ".json"
	reqPath := filepath.Join(n.Machine.Share(), name)
	b, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	if err := writeRenamed(reqPath, b); err != nil {
		return nil, err
	}
	defer os.Remove(reqPath)
	defer os.Remove(reqPath + ".out")
	out, err := n.Exec(ctx, timeout, "env", benchEnv+"="+filepath.Join(vm.GuestShareDir, name), filepath.Join(n.dir, "agent"))
	if err != nil {
		return nil, fmt.Errorf("%w: %s", err, out)
	}
	var res BenchResult
	if b, err = os.ReadFile(reqPath + ".out"); err == nil {
		err = json.Unmarshal(b, &res)
	}
	if err != nil {
		return nil, fmt.Errorf("node: bench result: %w (output: %s)", err, out)
	}
	if res.Error != "" {
		return &res, fmt.Errorf("node: bench in the guest: %s", res.Error)
	}
	return &res, nil
}

// StartIdeal starts the ideal external provisioner of req.Ideal.Provisioner in the guest, with
// Source mounted by mount-utils as its export, and returns once it serves. Each claim it is
// handed gets a directory on the export, made through the kernel client, and a PV pre-bound to
// it; each of its PVs that is Released gets its directory removed, then is deleted. stop ends
// it. While it runs, the node serves no other request (Exec, Bench, ...).
func (n *Node) StartIdeal(ctx context.Context, req BenchRequest, adminKubeconfig string) (stop func() error, err error) {
	id := strconv.FormatInt(controlSeq.Add(1), 10)
	kc := "ideal-" + id + ".kubeconfig"
	if err := copyFile(adminKubeconfig, filepath.Join(n.Machine.Share(), kc), 0o600); err != nil {
		return nil, err
	}
	req.Ideal.Kubeconfig = filepath.Join(vm.GuestShareDir, kc)
	name := "bench-" + id + ".json"
	reqPath := filepath.Join(n.Machine.Share(), name)
	cleanup := func() {
		for _, p := range []string{kc, name, name + ".out", name + ".ready", name + ".stop"} {
			os.Remove(filepath.Join(n.Machine.Share(), p))
		}
	}
	b, err := json.Marshal(req)
	if err == nil {
		err = writeRenamed(reqPath, b)
	}
	if err != nil {
		cleanup()
		return nil, err
	}
	done := make(chan error, 1)
	go func() {
		out, err := n.Exec(ctx, time.Hour, "env", benchEnv+"="+filepath.Join(vm.GuestShareDir, name), filepath.Join(n.dir, "agent"))
		if err != nil {
			err = fmt.Errorf("%w: %s", err, out)
		}
		done <- err
	}()
	result := func() error {
		var res BenchResult
		b, err := os.ReadFile(reqPath + ".out")
		if err == nil {
			err = json.Unmarshal(b, &res)
		}
		if err == nil && res.Error != "" {
			err = errors.New(res.Error)
		}
		if err != nil {
			return fmt.Errorf("node: ideal provisioner in the guest: %w", err)
		}
		return nil
	}
	err = waitReady(ctx, reqPath+".ready", done)
	if err != nil {
		_ = writeRenamed(reqPath+".stop", nil)
		<-done
		err = errors.Join(err, result())
		cleanup()
		return nil, fmt.Errorf("node: ideal provisioner in the guest: %w", err)
	}
	return func() error {
		defer cleanup()
		if err := writeRenamed(reqPath+".stop", nil); err != nil {
			return err
		}
		if err := <-done; err != nil {
			return err
		}
		return result()
	}, nil
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

func runBench(ctx context.Context, req BenchRequest, res *BenchResult, reqPath string) error {
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
	// Not RemoveAll: a mount left below would have its files removed.
	defer removeEmpty(work, filepath.Join(work, "ideal"), filepath.Join(work, "dirs"), filepath.Join(work, "bare"), filepath.Join(work, "csi", "mount"), filepath.Join(work, "csi"))
	mounter := mount.New("")
	if req.Ideal != nil {
		return runIdeal(ctx, mounter, req, filepath.Join(work, "ideal"), reqPath)
	}
	if req.Dirs > 0 {
		if res.Mkdir, res.Rmdir, err = dirsFloor(mounter, req, filepath.Join(work, "dirs")); err != nil {
			return err
		}
	}
	if req.Publish > 0 {
		if req.PodUID == "" {
			return errors.New("publish: no pod UID for the targets")
		}
		return publishRounds(ctx, mounter, req, work, res)
	}
	return nil
}

// removeEmpty removes the empty directories of paths, last first.
func removeEmpty(paths ...string) {
	for i := len(paths) - 1; i >= 0; i-- {
		_ = os.Remove(paths[i])
	}
}

// dirsFloor mounts req.Source at target, makes req.Dirs directories in it, req.Parallel at a
// time, then removes them, and returns how long each half took: what any provisioner on this
// export must do at least.
func dirsFloor(mounter mount.Interface, req BenchRequest, target string) (mkdir, rmdir time.Duration, err error) {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return 0, 0, err
	}
	if err := mounter.Mount(req.Source, target, "nfs", req.Options); err != nil {
		return 0, 0, err
	}
	defer func() {
		if uerr := mounter.Unmount(target); uerr != nil && err == nil {
			err = uerr
		}
	}()
	parent, err := os.MkdirTemp(target, "dirpv-bench-floor-")
	if err != nil {
		return 0, 0, err
	}
	defer os.Remove(parent)
	each := func(fn func(string) error) (time.Duration, error) {
		t0 := time.Now()
		err := Parallel(req.Dirs, max(1, req.Parallel), func(i int) error {
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
// mounts of the same source, so that load from elsewhere on the machine hits both alike.
func publishRounds(ctx context.Context, mounter mount.Interface, req BenchRequest, work string, res *BenchResult) error {
	conn, err := grpc.NewClient("unix://"+CSISocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("dial CSI socket %s: %w", CSISocket, err)
	}
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: req.Options}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
	}
	// kubelet makes the target's parent; the plugin makes the target.
	target := filepath.Join(work, "csi", "mount")
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return err
	}
	publish := func() error {
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		_, err := node.NodePublishVolume(cctx, &csi.NodePublishVolumeRequest{
			VolumeId: req.VolumeID, TargetPath: target, VolumeCapability: capability, VolumeContext: req.Attrs,
		})
		if err == nil {
			_, err = node.NodeUnpublishVolume(cctx, &csi.NodeUnpublishVolumeRequest{VolumeId: req.VolumeID, TargetPath: target})
		}
		if err != nil {
			return fmt.Errorf("publish/unpublish: %w", err)
		}
		return nil
	}
	bare := filepath.Join(work, "bare")
	if err := os.MkdirAll(bare, 0o750); err != nil {
		return err
	}
	bareMount := func() error {
		if err := mounter.Mount(req.Source, bare, "nfs", req.Options); err != nil {
			return err
		}
		return mounter.Unmount(bare)
	}
	per := max(1, req.Publish/max(1, req.Rounds))
	for r := 0; r < max(1, req.Rounds); r++ {
		p, err := timed(per, publish)
		if err != nil {
			return err
		}
		m, err := timed(per, bareMount)
		if err != nil {
			return err
		}
		res.Publish, res.Mount = append(res.Publish, p...), append(res.Mount, m...)
	}
	return nil
}

// timed runs fn iters times after one unmeasured run (connection set-up, first mount of the
// export) and returns each measured run's time.
func timed(iters int, fn func() error) ([]time.Duration, error) {
	var out []time.Duration
	for i := -1; i < iters; i++ {
		t0 := time.Now()
		if err := fn(); err != nil {
			return nil, err
		}
		if i >= 0 {
			out = append(out, time.Since(t0))
		}
	}
	return out, nil
}

// Parallel runs fn(i) for i in [0,n), k at a time, and returns the first error.
func Parallel(n, k int, fn func(i int) error) error {
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	next := make(chan int)
	for range k {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := fn(i); err != nil {
					once.Do(func() { first = err })
				}
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	return first
}
