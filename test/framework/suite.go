package framework

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/dirpv/dirpv/test/cluster"
)

// SuiteOptions says what a suite needs besides its workspace and its cluster.
type SuiteOptions struct {
	// Name names the workspace (dirpv-<Name>-*), the namespaces of NewNamespace (<Name>-*)
	// and the setup time printed.
	Name string
	// Cluster starts the cluster. Its WorkDir defaults to the workspace's, so that the
	// components' logs are kept with dirpv's when a run fails.
	Cluster cluster.Options
	// BeforeCluster, if set, runs once the workspace exists and may change the cluster's
	// options (e.g. audit flags that write into the workspace).
	BeforeCluster func(s *Suite, opts *cluster.Options) error
	// Dirpv builds cmd/dirpv into the workspace (Suite.Dirpv).
	Dirpv bool
	// NFS makes an export that is a local directory (Suite.NFS, see Export), which the
	// dirpv processes the suite starts mount.
	NFS bool
	// KeepLogs keeps the workspace even after a successful run.
	KeepLogs bool
}

// Suite is what every suite's TestMain (and the bench) sets up: a workspace, a cluster and a
// client for it, and, where asked, the dirpv binary and an export. Everything it starts is
// stopped by Close, or on SIGINT/SIGTERM.
type Suite struct {
	Options  SuiteOptions
	Cleanups *Cleanups
	Work     *Workspace
	Cluster  *cluster.Cluster
	Client   kubernetes.Interface
	Dirpv    string
	NFS      *Export
	// Daemons are the processes that must run through the whole suite: RunSuite fails the
	// run if one of them has exited at the end.
	Daemons []*Process
}

// StartSuite sets up what opts asks for. On error, what was started is stopped again.
func StartSuite(ctx context.Context, opts SuiteOptions) (_ *Suite, err error) {
	s := &Suite{Options: opts, Cleanups: NewCleanups()}
	defer func() {
		if err != nil {
			s.Cleanups.Run()
		}
	}()
	if s.Work, err = NewWorkspace("dirpv-"+opts.Name+"-", s.Cleanups, opts.KeepLogs); err != nil {
		return nil, err
	}
	copts := opts.Cluster
	if copts.WorkDir == "" {
		copts.WorkDir = filepath.Join(s.Work.Dir, "c")
	}
	if opts.BeforeCluster != nil {
		if err := opts.BeforeCluster(s, &copts); err != nil {
			return nil, err
		}
	}
	if s.Cluster, err = cluster.Start(ctx, copts); err != nil {
		return nil, fmt.Errorf("start cluster: %w", err)
	}
	s.Cleanups.Add(func() { s.Cluster.Stop() })
	if s.Client, err = s.Cluster.Client(); err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	if opts.Dirpv {
		if s.Dirpv, err = BuildDirpv(ctx, s.Work.Dir); err != nil {
			return nil, err
		}
	}
	if opts.NFS {
		if s.NFS, err = NewExport(s.Work); err != nil {
			return nil, fmt.Errorf("NFS export: %w", err)
		}
	}
	return s, nil
}

// Close stops everything the suite started, last started first.
func (s *Suite) Close() { s.Cleanups.Run() }

// StartDirpv runs `dirpv <subcommand>` against the suite's cluster (StartDirpv, with
// --kubeconfig, and the export's mount wrapper on its PATH), logging into the workspace, and
// stops it at Close.
func (s *Suite) StartDirpv(ctx context.Context, name, subcommand string, args ...string) (*Process, error) {
	return s.StartDirpvBin(ctx, s.Dirpv, name, subcommand, args...)
}

// StartDirpvBin is StartDirpv with another dirpv binary than the suite's.
func (s *Suite) StartDirpvBin(ctx context.Context, bin, name, subcommand string, args ...string) (*Process, error) {
	var env []string
	if s.NFS != nil {
		env = s.NFS.Env()
	}
	p, err := StartDirpvEnv(ctx, env, bin, name, s.Work.LogDir, subcommand, append([]string{"--kubeconfig", s.Cluster.Kubeconfig}, args...)...)
	if err != nil {
		return nil, err
	}
	s.Cleanups.Add(func() { p.Stop(10 * time.Second) })
	return p, nil
}

// RunSuite is a suite's TestMain: it parses the flags (adding -keep-logs), starts the suite,
// runs setup, then the tests, and returns the exit code. The run fails if a daemon exited
// during the tests; the workspace is kept, with its path printed, when the run fails.
func RunSuite(m *testing.M, opts SuiteOptions, setup func(ctx context.Context, s *Suite) error) int {
	keep := flag.Bool("keep-logs", false, "keep the workspace with the processes' logs after the run")
	flag.Parse()
	opts.KeepLogs = opts.KeepLogs || *keep
	ctx := context.Background()
	start := time.Now()
	s, err := StartSuite(ctx, opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s setup: %v\n", opts.Name, err)
		return 1
	}
	defer s.Close()
	if setup != nil {
		if err := setup(ctx, s); err != nil {
			fmt.Fprintf(os.Stderr, "%s setup: %v\n", opts.Name, err)
			return 1
		}
	}
	fmt.Fprintf(os.Stderr, "%s setup took %s\n", opts.Name, time.Since(start).Round(time.Millisecond))
	code := m.Run()
	for _, p := range s.Daemons {
		if exited, err := p.Exited(); exited {
			fmt.Fprintf(os.Stderr, "%s exited during the tests: %v\n%s\n", p.Name, err, p.Tail(4000))
			code = 1
		}
	}
	if code == 0 {
		s.Work.Succeeded()
	}
	return code
}
