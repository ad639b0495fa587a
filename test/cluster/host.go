package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"
	"k8s.io/mount-utils"
)

// hostChanges records the host state before the node started, so that Stop reverts exactly
// what kubelet, containerd and the CNI plugins changed outside WorkDir and nothing else.
type hostChanges struct {
	// CreatedDirs did not exist before Start; removed on Stop (after unmounting below them).
	// kubelet, libcni and containerd create these regardless of --root-dir / config.
	CreatedDirs []string `json:"createdDirs"`
	// CgroupDirs are kubepods hierarchies kubelet will create: one per cgroup v1 controller,
	// or the one of the unified (v2) hierarchy.
	CgroupDirs []string `json:"cgroupDirs"`
	// IPForward is net.ipv4.ip_forward before Start; the bridge plugin sets it to 1.
	IPForward string `json:"ipForward"`
	// Bridge is the CNI bridge to delete; empty when it existed before us.
	Bridge string `json:"bridge,omitempty"`
	// NetnsBefore lists /run/netns before Start; newer entries are pod sandboxes' netns.
	NetnsBefore []string `json:"netnsBefore"`
	// ShimAddress identifies our containerd's shims by their -address argument.
	ShimAddress string `json:"shimAddress"`
	// SharedRoot is set when Start made / a shared mount (shareRoot); Stop makes it private
	// again.
	SharedRoot bool `json:"sharedRoot,omitempty"`
}

// LocalBase is the base path of deploy/'s default local class, which `make up` and the
// install suites use as a user would.
const LocalBase = "/var/lib/dirpv"

// shareRoot makes / a shared mount, as systemd makes it on real nodes and kind in its node
// containers. dirpv's node pod mounts LocalBase with HostToContainer propagation, so that a
// disk an admin mounts beneath it after the pod started reaches the pod; containerd refuses
// that propagation from a private mount, and the pod would keep writing to the empty
// directory under the disk. Only / itself changes, not the mounts beneath it, and Stop makes
// it private again; a disk mounted meanwhile stays mounted.
func (h *hostChanges) shareRoot() error {
	if err := os.MkdirAll(LocalBase, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", LocalBase, err)
	}
	if sharedMount(LocalBase) {
		return nil
	}
	if err := unix.Mount("", "/", "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make / a shared mount: %w", err)
	}
	h.SharedRoot = true
	if !sharedMount(LocalBase) {
		return fmt.Errorf("%s is on a mount of its own that is not shared: make it shared (mount --make-shared) for HostToContainer propagation", LocalBase)
	}
	return nil
}

// sharedMount reports whether dir is on a mount that propagates to its peers: the mount with
// the deepest mount point at or above dir has a shared:N tag in /proc/self/mountinfo.
func sharedMount(dir string) bool {
	best, shared := "", false
	for _, mi := range mountInfos() {
		if mp := mi.MountPoint; (mp == "/" || mp == dir || strings.HasPrefix(dir, mp+"/")) && len(mp) >= len(best) {
			best = mp
			shared = slices.ContainsFunc(mi.OptionalFields, func(f string) bool { return strings.HasPrefix(f, "shared:") })
		}
	}
	return shared
}

const netnsDir = "/run/netns"

// hostDirs are the fixed paths the node may create outside WorkDir.
var hostDirs = []string{KubeletRootDir, "/var/lib/cni", "/var/log/containers", "/var/log/pods",
	"/run/containerd", netnsDir, "/var/lib/kubelet/device-plugins"}

func snapshotHost(socket string) (*hostChanges, error) {
	h := &hostChanges{ShimAddress: socket}
	for _, d := range hostDirs {
		if _, err := os.Lstat(d); os.IsNotExist(err) {
			h.CreatedDirs = append(h.CreatedDirs, d)
		}
	}
	ctrls, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return nil, fmt.Errorf("read /sys/fs/cgroup: %w", err)
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		ctrls = nil // cgroup v2: one hierarchy, whose subdirectories are cgroups, not controllers
		if _, err := os.Stat("/sys/fs/cgroup/kubepods"); os.IsNotExist(err) {
			h.CgroupDirs = append(h.CgroupDirs, "/sys/fs/cgroup/kubepods")
		}
	}
	for _, e := range ctrls {
		d := filepath.Join("/sys/fs/cgroup", e.Name(), "kubepods")
		if _, err := os.Stat(filepath.Dir(d)); err != nil || !e.IsDir() {
			continue
		}
		if _, err := os.Stat(d); os.IsNotExist(err) {
			h.CgroupDirs = append(h.CgroupDirs, d)
		}
	}
	fwd, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
	if err != nil {
		return nil, fmt.Errorf("read ip_forward: %w", err)
	}
	h.IPForward = strings.TrimSpace(string(fwd))
	if _, err := os.Stat("/sys/class/net/" + bridgeName); os.IsNotExist(err) {
		h.Bridge = bridgeName
	}
	if ents, err := os.ReadDir(netnsDir); err == nil {
		for _, e := range ents {
			h.NetnsBefore = append(h.NetnsBefore, e.Name())
		}
	}
	return h, nil
}

// killPods SIGKILLs every process in the kubepods cgroups (pod containers and sandboxes), then
// our containerd's shims. It runs after kubelet stopped, so nothing restarts them.
func (c *Cluster) killPods() []error {
	if c.Host == nil {
		return nil
	}
	var errs []error
	err := poll(context.Background(), 20*time.Second, 100*time.Millisecond, "pod processes gone", nil, func(context.Context) (bool, error) {
		pids := cgroupPIDs(c.Host.CgroupDirs)
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		return len(pids) == 0, nil
	})
	if err != nil {
		errs = append(errs, err)
	}
	shims := shimPIDs(c.Host.ShimAddress)
	for _, pid := range shims {
		st, _ := procStartTime(pid)
		p := &Proc{Name: "containerd-shim", PID: pid, StartTime: st}
		if err := p.stop(5 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// cgroupPIDs lists the processes in the given cgroup trees.
func cgroupPIDs(roots []string) []int {
	seen := map[int]bool{}
	var pids []int
	for _, root := range roots {
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			b, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
			if err != nil {
				return nil
			}
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && !seen[pid] && pid != os.Getpid() {
					seen[pid] = true
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}

// shimPIDs finds containerd-shim processes started by the containerd listening on address.
func shimPIDs(address string) []int {
	procs, _ := procfs.AllProcs()
	var pids []int
	for _, p := range procs {
		args, err := p.CmdLine()
		if err != nil || len(args) == 0 || !strings.Contains(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		if i := slices.Index(args, "-address"); i >= 0 && i+1 < len(args) && args[i+1] == address {
			pids = append(pids, p.PID)
		}
	}
	return pids
}

// revert undoes the recorded host changes. Processes must be stopped already.
func (h *hostChanges) revert(c *Cluster) []error {
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	// Mounts first: pod volumes and kubelet's own rshared bind mount of its root dir, the
	// sandboxes' netns bind mounts, container rootfs and shm mounts under containerd's state.
	add(unmountUnder(KubeletRootDir))
	if h.SharedRoot {
		add(unix.Mount("", "/", "", unix.MS_PRIVATE, ""))
	}
	add(unmountUnder(c.WorkDir))
	add(unmountUnder("/run/containerd"))
	before := map[string]bool{}
	for _, n := range h.NetnsBefore {
		before[n] = true
	}
	if ents, err := os.ReadDir(netnsDir); err == nil {
		for _, e := range ents {
			if before[e.Name()] {
				continue
			}
			p := filepath.Join(netnsDir, e.Name())
			add(unmountUnder(p))
			add(os.Remove(p))
		}
	}
	if h.Bridge != "" {
		if _, err := os.Stat("/sys/class/net/" + h.Bridge); err == nil {
			if out, err := exec.Command("ip", "link", "delete", h.Bridge).CombinedOutput(); err != nil {
				add(fmt.Errorf("delete bridge %s: %v: %s", h.Bridge, err, strings.TrimSpace(string(out))))
			}
		}
	}
	if h.IPForward != "" {
		add(os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte(h.IPForward+"\n"), 0o644))
	}
	// A cgroup can be removed only once the kernel has released its last task, which lags the
	// SIGKILL slightly; rmdir children before parents.
	add(poll(context.Background(), 10*time.Second, 100*time.Millisecond, "remove kubepods cgroups", nil, func(context.Context) (bool, error) {
		left := 0
		for _, root := range h.CgroupDirs {
			left += rmdirTree(root)
		}
		return left == 0, nil
	}))
	// Remove created dirs deepest first, and never one that still has a mount below it:
	// RemoveAll would follow a bind-mounted hostPath volume into the host's data.
	dirs := append([]string(nil), h.CreatedDirs...)
	sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
	for _, d := range dirs {
		if mps := mountsUnder(d); len(mps) > 0 {
			add(fmt.Errorf("not removing %s: still mounted below it: %v", d, mps))
			continue
		}
		add(os.RemoveAll(d))
	}
	return errs
}

// rmdirTree removes a cgroup directory tree bottom-up and returns how many directories are left.
func rmdirTree(root string) int {
	var dirs []string
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	left := 0
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := unix.Rmdir(dirs[i]); err != nil && !os.IsNotExist(err) {
			left++
		}
	}
	return left
}

// mountsUnder returns mount points equal to or below dir, deepest first.
func mountsUnder(dir string) []string {
	dir = filepath.Clean(dir)
	var mps []string
	for _, mi := range mountInfos() {
		if mp := mi.MountPoint; mp == dir || strings.HasPrefix(mp, dir+"/") {
			mps = append(mps, mp)
		}
	}
	sort.SliceStable(mps, func(i, j int) bool { return strings.Count(mps[i], "/") > strings.Count(mps[j], "/") })
	return mps
}

// mountInfos is this mount namespace's mount table, in its order (a mount stacked on another
// comes after it); none if it cannot be read.
func mountInfos() []mount.MountInfo {
	infos, _ := mount.ParseMountInfo("/proc/self/mountinfo")
	return infos
}

// unmountUnder unmounts everything mounted at or below dir, deepest first. Lazy unmount is the
// fallback for busy mounts: the test host must not keep them after Stop.
func unmountUnder(dir string) error {
	for pass := 0; pass < 10; pass++ {
		mps := mountsUnder(dir)
		if len(mps) == 0 {
			return nil
		}
		for _, mp := range mps {
			if err := unix.Unmount(mp, 0); err != nil {
				_ = unix.Unmount(mp, unix.MNT_DETACH)
			}
		}
	}
	if mps := mountsUnder(dir); len(mps) > 0 {
		return fmt.Errorf("still mounted under %s: %v", dir, mps)
	}
	return nil
}
