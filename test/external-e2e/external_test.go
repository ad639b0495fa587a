// Package externale2e runs Kubernetes' own External Storage e2e suite (e2e.test of
// k8s.io/kubernetes at the cluster's version, test/e2e/storage/external) against dirpv installed
// from deploy/ on a real single-node cluster: one run of the suite per driver definition file in
// this directory. README.md lists what is left out and why.
package externale2e

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onsi/ginkgo/v2/types"
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
var skips = []struct {
	pattern, reason string
	// applies, if set, says whether the skip is needed on this host.
	applies func() bool
}{
	{pattern: `\[Disruptive\]`, reason: "restarts kubelet or the node (over SSH, or by killing it); this cluster's " +
		"kubelet is a process of the test run, with no SSH and no service manager to restart it. " +
		"The peers (csi-driver-host-path, csi-driver-nfs) skip these too."},
	{pattern: `\(immediate.binding\)`, reason: "a local class must be WaitForFirstConsumer: dirpv makes the " +
		"directory on the node the pod is scheduled to, and refuses a claim of an Immediate copy " +
		"of dirpv-local with an event (DESIGN.md, bad input), as test/integration TestRejectionsAreEventsAndTouchNothing checks."},
	{pattern: `provisioning should provision storage with any volume data source`, reason: "runs " +
		"kubernetes-csi's hello-populator and volume-data-source-validator, whose images are not " +
		"reachable and whose modules the Go module proxy refuses here (403), so they cannot be built."},
	{pattern: `volumeMode should not mount / map unused volumes`, reason: "the suite looks at kubelet's " +
		"pod directory from a privileged pod through nsenter into PID 1's mount namespace, which " +
		"this host refuses even to root (a sandbox's PID 1).", applies: pid1NamespaceClosed},
	{pattern: `should provision correct filesystem size when restoring snapshot to larger size pvc`, reason: "the " +
		"pod's df must show the restored claim's size, which only a project quota makes statfs report " +
		"(XFS, ext4 with prjquota); the suite's base has none, so df shows the base's file system for " +
		"both claims (btrfs qgroups enforce, but statfs does not report them either).", applies: baseWithoutProjectQuota},
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
	if err := os.WriteFile(repoList, []byte(repoListYAML), 0o644); err != nil {
		return fmt.Errorf("write repo list: %w", err)
	}
	return provideImages(ctx, s, filepath.Join(binDir, "e2e.test"), filepath.Join(binDir, "agnhost"), repoList)
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
		t.Run(strings.TrimSuffix(d, ".yaml"), func(t *testing.T) { runDriver(t, d) })
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

func runDriver(t *testing.T, driverFile string) {
	abs, err := filepath.Abs(driverFile)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.TrimSuffix(driverFile, ".yaml")
	reportDir := filepath.Join(suite.Work.Dir, "report-"+name)
	if err := os.MkdirAll(reportDir, 0o755); err != nil {
		t.Fatal(err)
	}
	report := filepath.Join(reportDir, "report.json")
	skip := make([]string, 0, len(skips)+1)
	for _, s := range skips {
		if s.applies == nil || s.applies() {
			skip = append(skip, s.pattern)
			t.Logf("not run here: %s: %s", s.pattern, s.reason)
		}
	}
	if *extraSkp != "" {
		skip = append(skip, *extraSkp)
	}
	args := []string{
		"-procs=" + strconv.Itoa(*procs),
		"-focus=" + *focus,
		"-skip=" + strings.Join(skip, "|"),
		"-json-report=" + report,
		"-timeout=1h",
		"-no-color",
		filepath.Join(binDir, "e2e.test"),
		"--",
		"-kubeconfig=" + suite.Cluster.Kubeconfig,
		"-provider=skeleton",
		"-storage.testdriver=" + abs,
		"-report-dir=" + reportDir,
		// Control-plane components are host processes here, not pods or systemd units.
		"-disable-log-dump",
		"-kubelet-root-dir=" + suite.Cluster.KubeletRootDir,
	}
	logPath := filepath.Join(suite.Work.LogDir, "e2e-"+name+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour+10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "ginkgo"), args...)
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+repoList)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.Dir = reportDir
	start := time.Now()
	t.Logf("running %s (log: %s)", strings.Join(cmd.Args, " "), logPath)
	runErr := cmd.Run()
	took := time.Since(start).Round(time.Second)

	specs, err := readReport(report)
	if err != nil {
		t.Fatalf("e2e.test (%v after %s): %v; log tail:\n%s", runErr, took, err, tailFile(logPath, 4000))
	}
	tierSkip := regexp.MustCompile(strings.Join(skip, "|"))
	var passed, failed []string
	var skippedBySuite, skippedHere int
	for _, s := range specs {
		switch {
		case s.State == types.SpecStatePassed:
			passed = append(passed, s.FullText())
		case s.State == types.SpecStateSkipped || s.State == types.SpecStatePending:
			if tierSkip.MatchString(s.FullText()) {
				skippedHere++
			} else {
				skippedBySuite++
			}
		default:
			failed = append(failed, fmt.Sprintf("%s [%s]: %s", s.FullText(), s.State, firstLine(s.Failure.Message)))
		}
	}
	// Printed, not only logged: this line is what the tier is for, with or without -v.
	fmt.Printf("external-e2e %s: %d passed, %d failed, %d skipped by the suite (capability not declared, "+
		"one node), %d skipped here (README.md) in %s (driver %s)\n",
		name, len(passed), len(failed), skippedBySuite, skippedHere, took, driverFile)
	for _, p := range passed {
		t.Logf("passed: %s", p)
	}
	for _, f := range failed {
		t.Errorf("failed: %s", f)
	}
	if len(failed) == 0 && runErr != nil {
		t.Errorf("e2e.test: %v with no failed test in its report; log tail:\n%s", runErr, tailFile(logPath, 4000))
	}
	if len(passed) == 0 {
		t.Errorf("no test of the suite ran for %s (focus %q): the driver file or the focus selects nothing", driverFile, *focus)
	}
}

// readReport returns the External Storage specs of a ginkgo JSON report (e2e.test reports its
// thousands of other specs as skipped), and any failed suite set-up node, which fails every
// test.
func readReport(path string) ([]types.SpecReport, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("ginkgo report: %w", err)
	}
	var reports []types.Report
	if err := json.Unmarshal(b, &reports); err != nil {
		return nil, fmt.Errorf("ginkgo report %s: %w", path, err)
	}
	var specs []types.SpecReport
	for _, r := range reports {
		for _, s := range r.SpecReports {
			external := s.LeafNodeType == types.NodeTypeIt && strings.Contains(s.FullText(), "External Storage [Driver: ")
			if external || s.State.Is(types.SpecStateFailureStates) {
				specs = append(specs, s)
			}
		}
	}
	return specs, nil
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(strings.TrimSpace(s), "\n")
	return s
}

func tailFile(path string, n int) string {
	b, _ := os.ReadFile(path)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
