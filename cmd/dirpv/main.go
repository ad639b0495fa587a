// Command dirpv is the dirpv provisioner and CSI node plugin. It only parses flags; the work
// is done in internal/daemon, provisioner and csinode.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/internal/daemon"
	"github.com/dirpv/dirpv/provisioner"
)

const usage = `dirpv turns directories on an NFS export or a node-local path into PersistentVolumes.

Usage:
  dirpv controller [flags]   provision NFS volumes (Deployment, leader-elected)
  dirpv node [flags]         CSI node plugin + local-volume provisioner for this node (DaemonSet)
  dirpv snapshot-controller  the common VolumeSnapshot controller, for clusters without one
  dirpv convert-class [flags]  read an nfs-subdir-external-provisioner (--nfs-server, --nfs-share)
                             or local-path-provisioner (--base-path) StorageClass on stdin, write
                             the dirpv class that replaces it under the same name (docs/migrating.md)
  dirpv version              print the version

Run "dirpv <command> -h" for the command's flags.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet("dirpv "+cmd, flag.ExitOnError)
	klog.InitFlags(fs)
	var run func(context.Context) error
	switch cmd {
	case "controller":
		run = controllerFlags(fs)
	case "node":
		run = nodeFlags(fs)
	case "snapshot-controller":
		run = snapshotControllerFlags(fs)
	case "convert-class":
		run = convertClassFlags(fs)
	case "version":
		fmt.Println(daemon.Version)
		return
	case "-h", "-help", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "dirpv: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	fs.Parse(args)
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "dirpv %s: unexpected arguments %q\n", cmd, fs.Args())
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if cmd == "convert-class" {
		if err := run(ctx); err != nil {
			fmt.Fprintf(os.Stderr, "dirpv convert-class: %v\n", err)
			os.Exit(1)
		}
		return
	}
	logger := klog.Background().WithValues("command", cmd)
	ctx = klog.NewContext(ctx, logger)
	logger.Info("Starting dirpv", "version", daemon.Version)
	if err := run(ctx); err != nil {
		logger.Error(err, "dirpv stopped")
		klog.FlushAndExit(klog.ExitFlushTimeout, 1)
	}
	klog.Flush()
}

// The API client and worker defaults come from `make bench`: client-go's own default of
// 5 QPS caps any provisioner at a few claims per second, far below what the cluster's
// controller-manager can bind. See docs/performance.md.
func commonFlags(fs *flag.FlagSet) (*daemon.KubeConfig, *daemon.ProvisionerConfig, *string, *bool) {
	kube := &daemon.KubeConfig{}
	prov := &daemon.ProvisionerConfig{}
	fs.StringVar(&kube.Path, "kubeconfig", "", "Path to a kubeconfig file. Empty: in-cluster configuration.")
	fs.Func("kube-api-qps", "Queries per second to the API server (default 100). Events have a budget of their own of the same size.", float32Flag(&kube.QPS))
	kube.QPS = 100
	fs.IntVar(&kube.Burst, "kube-api-burst", 200, "Burst of queries to the API server (and, apart, of events).")
	fs.IntVar(&prov.Workers, "worker-threads", 16, "Claims and volumes handled in parallel.")
	fs.DurationVar(&prov.OperationTimeout, "operation-timeout", 30*time.Second,
		"Deadline of each call that can hang on storage: NFS mounts, directory creation and removal on NFS, unmounts.")
	fs.DurationVar(&prov.Resync, "resync-period", 15*time.Minute, "Informer resync period.")
	fs.DurationVar(&prov.CloneTimeout, "clone-timeout", provisioner.DefaultCloneTimeout,
		"Deadline of each copy that starts a volume from a data source (a clone, a restore) or makes a VolumeSnapshot; the copy runs in the background meanwhile, and starts again after it.")
	fs.Func("copy-space-margin", "Free space a copy (a clone, a restore, a snapshot) must leave on its base beyond what its source occupies, "+
		"as a quantity (e.g. 1Gi; default 0). A copy that would leave less is not started: its claim or snapshot gets a "+
		provisioner.ReasonNoRoomForCopy+" event and is tried again later.", quantityFlag(&prov.CopySpaceMargin))
	fs.DurationVar(&prov.RetryIntervalStart, "retry-interval-start", daemon.DefaultRetryIntervalStart,
		"Delay before the first retry of a failed provision or delete; it doubles with each failure, up to --retry-interval-max. Retries never stop.")
	fs.DurationVar(&prov.RetryIntervalMax, "retry-interval-max", daemon.DefaultRetryIntervalMax,
		"Longest delay between retries of a failed provision or delete.")
	fs.Func("adopt-provisioners", "Comma-separated names of other provisioners (e.g. cluster.local/nfs-subdir-external-provisioner, rancher.io/local-path) "+
		"whose PVs dirpv deletes, retains or archives in their place, as the dirpv StorageClass that replaced theirs under the same name says. "+
		"Give the controller and the nodes the same list, and only once those provisioners are stopped. See docs/migrating.md.", func(s string) error {
		prov.Adopt = nil
		for _, name := range strings.Split(s, ",") {
			if name = strings.TrimSpace(name); name != "" {
				prov.Adopt = append(prov.Adopt, name)
			}
		}
		return nil
	})
	httpAddr := fs.String("http-address", ":9809", "Address for /healthz and /metrics. Empty disables them.")
	profiling := fs.Bool("profiling", false, "Also serve Go's /debug/pprof/ on --http-address (heap and CPU profiles).")
	return kube, prov, httpAddr, profiling
}

// capacityFlags are the CSIStorageCapacity publishing flags of both commands.
func capacityFlags(fs *flag.FlagSet) *daemon.CapacityConfig {
	c := &daemon.CapacityConfig{}
	fs.DurationVar(&c.PollInterval, "capacity-poll-interval", daemon.DefaultCapacityPollInterval,
		"How often CSIStorageCapacity objects are refreshed from the free space of each class's storage "+
			"(they are also refreshed after each provision and delete). 0 publishes none.")
	ns := os.Getenv("POD_NAMESPACE")
	if ns == "" {
		ns = daemon.DefaultNamespace
	}
	fs.StringVar(&c.Namespace, "capacity-namespace", ns, "Namespace of the CSIStorageCapacity objects. Default: $POD_NAMESPACE, else "+daemon.DefaultNamespace+".")
	return c
}

func quantityFlag(p *uint64) func(string) error {
	return func(s string) error {
		q, err := resource.ParseQuantity(s)
		if err != nil || q.Sign() < 0 {
			return fmt.Errorf("want a non-negative quantity such as 512Mi or 2Gi")
		}
		*p = uint64(q.Value())
		return nil
	}
}

func float32Flag(p *float32) func(string) error {
	return func(s string) error {
		var f float32
		if _, err := fmt.Sscan(s, &f); err != nil || f <= 0 {
			return fmt.Errorf("want a positive number")
		}
		*p = f
		return nil
	}
}

func controllerFlags(fs *flag.FlagSet) func(context.Context) error {
	cfg := daemon.ControllerConfig{}
	kube, prov, httpAddr, profiling := commonFlags(fs)
	fs.StringVar(&cfg.WorkDir, "work-dir", "/var/lib/dirpv-controller", "Directory under which NFS exports are mounted.")
	fs.DurationVar(&cfg.IdleUnmount, "idle-unmount", 5*time.Minute, "Unmount an NFS export after it has been unused this long.")
	fs.DurationVar(&cfg.WedgedExportLimit, "wedged-export-limit", 5*time.Minute,
		"/healthz fails once an NFS export has had all its call slots held by calls its server does not answer, none coming free, "+
			"for this long, so that kubelet restarts the controller. 0 disables the check.")
	capacity := capacityFlags(fs)
	leaderElectionFlags(fs, &cfg.LeaderElection)
	return func(ctx context.Context) error {
		cfg.Kube, cfg.Provisioner, cfg.HTTPAddress, cfg.Profiling, cfg.Capacity = *kube, *prov, *httpAddr, *profiling, *capacity
		return daemon.RunController(ctx, cfg)
	}
}

func leaderElectionFlags(fs *flag.FlagSet, le *daemon.LeaderElectionConfig) {
	fs.BoolVar(&le.Enabled, "leader-election", true, "Elect one active controller among replicas.")
	fs.StringVar(&le.Namespace, "leader-election-namespace", "", "Namespace of the leader election lease. Empty: the pod's own namespace.")
	fs.DurationVar(&le.LeaseDuration, "leader-election-lease-duration", 15*time.Second,
		"How long a standby waits before taking over a lease its leader stopped renewing (a crash; a clean stop hands over at once).")
	fs.DurationVar(&le.RenewDeadline, "leader-election-renew-deadline", 10*time.Second,
		"How long the leader retries renewing its lease before it stops and exits.")
	fs.DurationVar(&le.RetryPeriod, "leader-election-retry-period", 2*time.Second, "Interval between attempts to acquire or renew the lease.")
}

func snapshotControllerFlags(fs *flag.FlagSet) func(context.Context) error {
	cfg := daemon.SnapshotControllerConfig{}
	kube, prov, httpAddr, _ := commonFlags(fs)
	leaderElectionFlags(fs, &cfg.LeaderElection)
	return func(ctx context.Context) error {
		cfg.Kube, cfg.Workers, cfg.Resync, cfg.HTTPAddress = *kube, prov.Workers, prov.Resync, *httpAddr
		return daemon.RunSnapshotController(ctx, cfg)
	}
}

func convertClassFlags(fs *flag.FlagSet) func(context.Context) error {
	var to provisioner.ConvertTarget
	fs.StringVar(&to.Server, "nfs-server", "", "nfs-subdir-external-provisioner's NFS server (its NFS_SERVER).")
	fs.StringVar(&to.Share, "nfs-share", "", "nfs-subdir-external-provisioner's exported path (its NFS_PATH).")
	fs.StringVar(&to.BasePath, "base-path", "", "local-path-provisioner's node path (its nodePathMap; kind's is /var/local-path-provisioner).")
	return func(context.Context) error {
		return provisioner.ConvertClassManifest(os.Stdin, os.Stdout, to, daemon.DriverName)
	}
}

func nodeFlags(fs *flag.FlagSet) func(context.Context) error {
	cfg := daemon.NodeConfig{}
	kube, prov, httpAddr, profiling := commonFlags(fs)
	fs.StringVar(&cfg.NodeName, "node-name", os.Getenv("NODE_NAME"), "This node's name. Default: $NODE_NAME.")
	fs.StringVar(&cfg.KubeletRootDir, "kubelet-root-dir", "/var/lib/kubelet", "kubelet's root directory. No local volume is ever mounted from in or around it.")
	cfg.AllowedBasePaths = []string{daemon.DefaultBasePath}
	fs.Func("allowed-base-paths", "Comma-separated absolute host directories at or beneath which local volumes may live: "+
		"the basePaths the DaemonSet mounts. A local PV or class naming any other is refused. Empty: no local volumes. "+
		"(default "+daemon.DefaultBasePath+")", func(s string) error {
		cfg.AllowedBasePaths = nil
		for _, p := range strings.Split(s, ",") {
			if p = strings.TrimSpace(p); p != "" {
				cfg.AllowedBasePaths = append(cfg.AllowedBasePaths, p)
			}
		}
		return nil
	})
	fs.StringVar(&cfg.CSIEndpoint, "csi-endpoint", "", "CSI socket, unix:///path. Default: <kubelet-root-dir>/plugins/dirpv.io/csi.sock.")
	fs.StringVar(&cfg.StateDir, "state-dir", "", "Host directory where the node remembers which file system each local base is, so that a base whose disk "+
		"did not mount is refused instead of used. Must outlive the pod and be on no base. Default: the directory of --csi-endpoint's socket.")
	fs.StringVar(&cfg.RegistrationDir, "plugin-registration-dir", "", "kubelet's plugin registration directory. Default: <kubelet-root-dir>/plugins_registry. \"-\" disables self-registration.")
	fs.BoolVar(&cfg.LocalProvisioning, "local-provisioning", true, "Provision local-class volumes scheduled to this node.")
	fs.BoolVar(&cfg.WatchAllVolumes, "watch-all-volumes", false, "Watch every claim and PV of the cluster, not only those dirpv controller labelled "+
		"dirpv.io/node=<this node>: for clusters that run no dirpv controller, whose cloning-protection finalizer the node then removes too. "+
		"Memory and watch traffic then grow with the cluster.")
	fs.DurationVar(&cfg.QuotaCheckPeriod, "quota-check-period", daemon.DefaultQuotaCheckPeriod,
		"How often the node walks its limited local volumes for data outside their limits: files a tenant moved out of its volume's XFS or ext4 "+
			"project quota are moved back, nested btrfs subvolumes are reported; either gets a QuotaEscape event on the claim. 0 disables the checks.")
	fs.IntVar(&cfg.MaxLocalCopies, "max-local-copies", provisioner.DefaultMaxLocalCopies,
		"Copies of local volumes (clones, restores, snapshots) that may run at once on this node; the others wait for one to end "+
			"(dirpv_copies_waiting). Each holds a few MiB of memory at most, whatever the tree.")
	capacity := capacityFlags(fs)
	fs.StringVar(&capacity.PodName, "pod-name", os.Getenv("POD_NAME"),
		"Name of the pod this runs in, the owner of the node's CSIStorageCapacity objects (they go with it). Default: $POD_NAME; empty: no owner.")
	fs.StringVar(&capacity.PodUID, "pod-uid", os.Getenv("POD_UID"), "UID of that pod. Default: $POD_UID.")
	capacity.PodNamespace = os.Getenv("POD_NAMESPACE")
	return func(ctx context.Context) error {
		cfg.Kube, cfg.Provisioner, cfg.HTTPAddress, cfg.Profiling, cfg.Capacity = *kube, *prov, *httpAddr, *profiling, *capacity
		if cfg.CSIEndpoint == "" {
			cfg.CSIEndpoint = daemon.DefaultCSIEndpoint(cfg.KubeletRootDir)
		}
		if cfg.StateDir == "" {
			cfg.StateDir = daemon.DefaultStateDir(cfg.CSIEndpoint, cfg.KubeletRootDir)
		}
		switch cfg.RegistrationDir {
		case "":
			cfg.RegistrationDir = daemon.DefaultRegistrationDir(cfg.KubeletRootDir)
		case "-":
			cfg.RegistrationDir = ""
		}
		return daemon.RunNode(ctx, cfg)
	}
}
