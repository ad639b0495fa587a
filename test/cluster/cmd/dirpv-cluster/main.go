// Command dirpv-cluster starts and stops the local test cluster of package
// github.com/dirpv/dirpv/test/cluster for interactive use; the cluster keeps running after the
// command exits.
//
//	go run ./test/cluster/cmd/dirpv-cluster up [--node] [--node-name NAME] [--kcm-arg=FLAG ...]
//	eval "$(go run ./test/cluster/cmd/dirpv-cluster env)"
//	go run ./test/cluster/cmd/dirpv-cluster down
//
// State (PIDs, paths, host changes) lives in $DIRPV_CLUSTER_DIR (default /tmp/dirpv-cluster),
// with the cluster's work dir, logs and kubeconfig inside it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/cluster"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "up":
		err = up(os.Args[2:])
	case "down":
		err = down()
	case "env":
		err = env()
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dirpv-cluster:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: dirpv-cluster up [--node] [--node-name NAME] [--bin-dir DIR] [--kcm-arg FLAG]... | down | env")
	os.Exit(2)
}

func stateDir() string {
	if d := os.Getenv("DIRPV_CLUSTER_DIR"); d != "" {
		return d
	}
	return "/tmp/dirpv-cluster"
}

func statePath() string { return filepath.Join(stateDir(), "state.json") }

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05.000 ")+format+"\n", args...)
}

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, " ") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func up(args []string) error {
	fs := flag.NewFlagSet("up", flag.ExitOnError)
	node := fs.Bool("node", false, "also start containerd and a kubelet (root only)")
	nodeName := fs.String("node-name", "", "node name (default dirpv-node)")
	binDir := fs.String("bin-dir", "", "directory with etcd and the Kubernetes binaries (default: run build.sh)")
	var kcmArgs multiFlag
	fs.Var(&kcmArgs, "kcm-arg", "extra kube-controller-manager flag, repeatable (e.g. --kcm-arg=--kube-api-qps=200)")
	_ = fs.Parse(args)

	if _, err := os.Stat(statePath()); err == nil {
		return fmt.Errorf("a cluster is already up (state %s); run `dirpv-cluster down` first", statePath())
	}
	workDir := filepath.Join(stateDir(), "w")
	if err := os.MkdirAll(workDir, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", workDir, err)
	}
	// Ctrl-C aborts a start in progress; Start then stops what it started.
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	t0 := time.Now()
	c, err := cluster.Start(ctx, cluster.Options{
		WorkDir:               workDir,
		BinDir:                *binDir,
		WithNode:              *node,
		NodeName:              *nodeName,
		ControllerManagerArgs: kcmArgs,
		Logf:                  logf,
	})
	if err != nil {
		return err
	}
	if err := c.SaveState(statePath()); err != nil {
		_ = c.Stop()
		return err
	}
	logf("cluster up in %s; logs in %s", time.Since(t0).Round(time.Millisecond), filepath.Join(workDir, "logs"))
	fmt.Printf("kubeconfig: %s\n", c.Kubeconfig)
	printEnv(c)
	return nil
}

func down() error {
	c, err := cluster.LoadState(statePath(), logf)
	if errors.Is(err, os.ErrNotExist) {
		logf("no cluster state at %s; nothing to stop", statePath())
		return nil
	}
	if err != nil {
		return err
	}
	if err := c.Stop(); err != nil {
		return err
	}
	return os.RemoveAll(stateDir())
}

func env() error {
	c, err := cluster.LoadState(statePath(), logf)
	if err != nil {
		return err
	}
	printEnv(c)
	return nil
}

func printEnv(c *cluster.Cluster) {
	fmt.Printf("export KUBECONFIG=%s\n", c.Kubeconfig)
	if c.ContainerdSocket != "" {
		// For `ctr` / `crictl` against the node's containerd.
		fmt.Printf("export CONTAINERD_ADDRESS=%s\n", c.ContainerdSocket)
		fmt.Printf("export CONTAINER_RUNTIME_ENDPOINT=unix://%s\n", c.ContainerdSocket)
	}
}
