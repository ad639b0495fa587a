// Package externale2e runs Kubernetes' own External Storage e2e suite (e2e.test of
// k8s.io/kubernetes at the cluster's version, test/e2e/storage/external) against dirpv installed
// from deploy/ on a real single-node cluster: one run of the suite per driver definition file in
// this directory. README.md lists what is left out and why.
package externale2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume/quota"
)

// basePath is the dirpv-local class's base as deploy/overlays/kind installs it.
const basePath = "/var/lib/dirpv"

// skips are the parts of the External Storage suite this tier does not run, each with why.
// Tests the suite skips itself because a capability is not declared in the driver file are
// not listed: they report as skipped.
var skips = []Skip{
	SkipDisruptive,
	{Pattern: `\(immediate.binding\)`, Reason: "a local class must be WaitForFirstConsumer: dirpv makes the " +
		"directory on the node the pod is scheduled to, and refuses a claim of an Immediate copy " +
		"of dirpv-local with an event (DESIGN.md, bad input), as test/integration TestRejectionsAreEventsAndTouchNothing checks."},
	SkipVolumeDataSource,
	{Pattern: `volumeMode should not mount / map unused volumes`, Reason: "the suite looks at kubelet's " +
		"pod directory from a privileged pod through nsenter into PID 1's mount namespace, which " +
		"this host refuses even to root (a sandbox's PID 1).", Applies: pid1NamespaceClosed},
	{Pattern: `should provision correct filesystem size when restoring snapshot to larger size pvc`, Reason: "the " +
		"pod's df must show the restored claim's size, which only a project quota makes statfs report " +
		"(XFS, ext4 with prjquota); the suite's base has none, so df shows the base's file system for " +
		"both claims (btrfs qgroups enforce, but statfs does not report them either).", Applies: baseWithoutProjectQuota},
}

// baseWithoutProjectQuota reports whether basePath (made by the install) is on a file system
// without project quota, where statfs of a volume reports the whole file system.
func baseWithoutProjectQuota() bool {
	fd, err := unix.Open(basePath, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return true
	}
	defer unix.Close(fd)
	fs, err := quota.Probe(fd)
	return err != nil || fs.Kind() != quota.Project
}

// pid1NamespaceClosed reports whether this host refuses to enter PID 1's mount namespace, as
// the suite's host-exec pods do (storage/utils.HostExec).
func pid1NamespaceClosed() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return exec.CommandContext(ctx, "nsenter", "--mount=/proc/1/ns/mnt", "--", "true").Run() != nil
}

var (
	focus    = flag.String("focus", `External.Storage`, "e2e.test -ginkgo.focus: the External Storage suite, or a part of it")
	extraSkp = flag.String("skip", "", "e2e.test -ginkgo.skip in addition to the tier's own skips")
	// The specs mostly wait (pods starting, namespaces going): parallel processes cut the run's
	// time even on 2 cores. [Serial] specs still run alone, at the end (ginkgo's Serial).
	procs = flag.Int("procs", 3, "ginkgo parallel processes running the specs")

	suite  *framework.Suite
	binDir string
	// repoList is the KUBE_TEST_REPO_LIST file: every registry the suite names mapped to
	// dirpv.local/..., where nothing is pulled from, so a pod whose image was not built here
	// fails visibly instead of reaching out.
	repoList string
)

func TestMain(m *testing.M) {
	os.Exit(framework.RunSuite(m, framework.SuiteOptions{
		Name:          "conformance",
		Cluster:       cluster.Options{WithNode: true, Logf: klog.Infof},
		BeforeCluster: beforeCluster,
	}, setup))
}

// beforeCluster builds e2e.test (cold: a long time) before a cluster waits for it, and makes
// sure the suite's volumes do not outlive it on the host.
func beforeCluster(s *framework.Suite, _ *cluster.Options) error {
	var err error
	if binDir, err = cluster.BuildE2E(context.Background()); err != nil {
		return fmt.Errorf("build e2e.test: %w", err)
	}
	before, baseErr := baseEntries()
	s.Cleanups.Add(func() {
		after, _ := baseEntries()
		for _, d := range after {
			if !slices.Contains(before, d) {
				os.RemoveAll(filepath.Join(basePath, d))
			}
		}
		if os.IsNotExist(baseErr) {
			os.Remove(basePath)
		}
	})
	return nil
}

// baseEntries lists the volume directories in basePath, and the snapshots in its snapshot
// directory (which stays, empty, once the first snapshot was made).
func baseEntries() ([]string, error) {
	entries, err := os.ReadDir(basePath)
	var names []string
	for _, e := range entries {
		if e.Name() != snapshotsDir {
			names = append(names, e.Name())
			continue
		}
		snaps, _ := os.ReadDir(filepath.Join(basePath, snapshotsDir))
		for _, s := range snaps {
			names = append(names, snapshotsDir+"/"+s.Name())
		}
	}
	return names, err
}

// snapshotsDir is where dirpv keeps a base's snapshots (volume.Root.Snapshot).
const snapshotsDir = ".dirpv-snapshots"

func setup(ctx context.Context, s *framework.Suite) error {
	suite = s
	if _, err := framework.Install(ctx, s.Cluster, klog.Infof); err != nil {
		return fmt.Errorf("install dirpv: %w", err)
	}
	repoList = filepath.Join(s.Work.Dir, "repo-list.yaml")
	if err := os.WriteFile(repoList, []byte(RepoListYAML), 0o644); err != nil {
		return fmt.Errorf("write repo list: %w", err)
	}
	return ProvideImages(ctx, s.Cluster, s.Cluster.BusyboxImage, s.Cluster.PauseImage, s.Work.Dir,
		filepath.Join(binDir, "e2e.test"), filepath.Join(binDir, "agnhost"), repoList)
}

// TestExternalStorage runs the suite once per driver file and fails if a test failed, or if a
// volume directory outlived the suite's namespaces.
func TestExternalStorage(t *testing.T) {
	drivers, err := filepath.Glob("*.yaml")
	if err != nil || len(drivers) == 0 {
		t.Fatalf("no driver files (*.yaml) in test/external-e2e: %v", err)
	}
	before, _ := baseEntries()
	for _, d := range drivers {
		t.Run(strings.TrimSuffix(d, ".yaml"), func(t *testing.T) {
			run := Run{Driver: d, BinDir: binDir, RepoList: repoList,
				Kubeconfig: suite.Cluster.Kubeconfig, KubeletRootDir: suite.Cluster.KubeletRootDir,
				WorkDir: suite.Work.Dir, LogDir: suite.Work.LogDir,
				Focus: *focus, Skips: skips, Procs: *procs, Timeout: time.Hour}
			if *extraSkp != "" {
				run.Skips = append(run.Skips, Skip{Pattern: *extraSkp, Reason: "-skip"})
			}
			run.Do(t)
		})
	}
	err = framework.Poll(context.Background(), 2*time.Minute, func(context.Context) (bool, error) {
		after, err := baseEntries()
		left := slices.DeleteFunc(after, func(n string) bool { return slices.Contains(before, n) })
		return len(left) == 0, fmt.Errorf("volume directories left in %s: %v (%v)", basePath, left, err)
	})
	if err != nil {
		t.Error(err)
	}
}
