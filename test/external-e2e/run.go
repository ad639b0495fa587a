package externale2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/onsi/ginkgo/v2/types"
)

// Skip is a part of the suite a tier does not run, with why; Applies, if set, says whether
// the skip is needed where the tier runs.
type Skip struct {
	Pattern, Reason string
	Applies         func() bool
}

// Skips that every tier here needs.
var (
	SkipDisruptive = Skip{Pattern: `\[Disruptive\]`, Reason: "restarts kubelet or the node (over SSH, or by killing it); " +
		"this cluster's kubelet is a process of the test run, with no SSH and no service manager to restart it. " +
		"The peers (csi-driver-host-path, csi-driver-nfs) skip these too."}
	SkipVolumeDataSource = Skip{Pattern: `provisioning should provision storage with any volume data source`, Reason: "runs " +
		"kubernetes-csi's hello-populator and volume-data-source-validator, whose images are not " +
		"reachable and whose modules the Go module proxy refuses here (403), so they cannot be built."}
)

// Run is one run of the suite with one driver file.
type Run struct {
	// Driver is the driver definition file (-storage.testdriver).
	Driver string
	// BinDir holds e2e.test and ginkgo (cluster.BuildE2E); RepoList is the
	// KUBE_TEST_REPO_LIST file (RepoListYAML).
	BinDir, RepoList string
	// Kubeconfig reaches the cluster; KubeletRootDir is its node's kubelet root.
	Kubeconfig, KubeletRootDir string
	// WorkDir gets the run's report, LogDir ginkgo's output.
	WorkDir, LogDir string
	// Focus selects the suite's tests (ginkgo -focus); Skips leave some out.
	Focus string
	Skips []Skip
	// Procs is the number of ginkgo processes running the specs.
	Procs int
	// Timeout bounds the suite's run.
	Timeout time.Duration
}

// Do runs the suite, prints a passed/failed/skipped line, and fails t for each failed test,
// or if no test ran.
func (r Run) Do(t *testing.T) {
	t.Helper()
	abs, err := filepath.Abs(r.Driver)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.TrimSuffix(filepath.Base(r.Driver), ".yaml")
	reportDir := filepath.Join(r.WorkDir, "report-"+name)
	if err := os.MkdirAll(reportDir, 0o755); err != nil {
		t.Fatal(err)
	}
	report := filepath.Join(reportDir, "report.json")
	var skip []string
	for _, s := range r.Skips {
		if s.Applies == nil || s.Applies() {
			skip = append(skip, s.Pattern)
			t.Logf("not run here: %s: %s", s.Pattern, s.Reason)
		}
	}
	args := []string{
		"-procs=" + strconv.Itoa(max(1, r.Procs)),
		"-focus=" + r.Focus,
		"-json-report=" + report,
		"-timeout=" + r.Timeout.String(),
		"-no-color",
	}
	if len(skip) > 0 {
		args = append(args, "-skip="+strings.Join(skip, "|"))
	}
	args = append(args,
		filepath.Join(r.BinDir, "e2e.test"),
		"--",
		"-kubeconfig="+r.Kubeconfig,
		"-provider=skeleton",
		"-storage.testdriver="+abs,
		"-report-dir="+reportDir,
		// Control-plane components are host processes here, not pods or systemd units.
		"-disable-log-dump",
		"-kubelet-root-dir="+r.KubeletRootDir,
	)
	logPath := filepath.Join(r.LogDir, "e2e-"+name+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logFile.Close()
	ctx, cancel := context.WithTimeout(context.Background(), r.Timeout+10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(r.BinDir, "ginkgo"), args...)
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+r.RepoList)
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
	focus, err := regexp.Compile(r.Focus)
	if err != nil {
		t.Fatalf("focus %q: %v", r.Focus, err)
	}
	var tierSkip *regexp.Regexp
	if len(skip) > 0 {
		tierSkip = regexp.MustCompile(strings.Join(skip, "|"))
	}
	var passed, failed []string
	var skippedBySuite, skippedHere, unfocused int
	for _, s := range specs {
		switch {
		case s.State == types.SpecStatePassed:
			passed = append(passed, s.FullText())
		case s.State == types.SpecStateSkipped || s.State == types.SpecStatePending:
			switch {
			case !focus.MatchString(s.FullText()):
				unfocused++
			case tierSkip != nil && tierSkip.MatchString(s.FullText()):
				skippedHere++
			default:
				skippedBySuite++
			}
		default:
			failed = append(failed, fmt.Sprintf("%s [%s]: %s", s.FullText(), s.State, firstLine(s.Failure.Message)))
		}
	}
	// Printed, not only logged: this line is what the run is for, with or without -v.
	fmt.Printf("external-e2e %s: %d passed, %d failed, %d skipped by the suite (capability not declared, "+
		"one node), %d skipped here, %d outside the focus, in %s (driver %s)\n",
		name, len(passed), len(failed), skippedBySuite, skippedHere, unfocused, took, r.Driver)
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
		t.Errorf("no test of the suite ran for %s (focus %q): the driver file or the focus selects nothing", r.Driver, r.Focus)
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
