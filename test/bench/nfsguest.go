package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm"
)

var flagNFSPubN = flag.Int("nfs-publish-n", 100, "NFS NodePublish+NodeUnpublish iterations in the VM (and as many bare NFS mounts); each takes ~0.5 s under emulation")

// nfsKernel is the NFS phase: provisioning, deleting and publishing NFS volumes through a
// kernel NFS client and server, which this host's kernel may lack. It runs in the VM node tier
// (test/vm/node's TestBenchNFS, run as a test: its network namespace, guest and deploy/
// install belong to that package's test binary), where dirpv runs in a Debian kernel's guest
// under emulation; every row comes with its reference from the same run there (that
// cluster's binding ceiling, the kernel client's mkdir/rmdir floor, a bare NFS mount), since
// the guest's figures compare with nothing measured on this host.
func (b *bench) nfsKernel() error {
	out := filepath.Join(b.s.Work.Dir, "nfs-vm.json")
	logPath := filepath.Join(b.s.Work.LogDir, "nfs-vm.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.CommandContext(b.ctx, "go", "test", "-count=1", "-timeout", "45m", "-v", "-run", "^TestBenchNFS$", "./test/vm/node/")
	cmd.Dir = framework.RepoRoot()
	cmd.Env = append(os.Environ(), "DIRPV_BENCH_NFS="+out,
		fmt.Sprintf("DIRPV_BENCH_N=%d", *flagN), fmt.Sprintf("DIRPV_BENCH_PUBLISH_N=%d", *flagNFSPubN))
	cmd.Stdout, cmd.Stderr = logf, logf
	fmt.Printf("   (VM node tier: go test -run TestBenchNFS ./test/vm/node/, log %s)\n", logPath)
	t0 := time.Now()
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("the VM node tier's NFS bench: %w; its log's tail:\n%s", err, logTail(logPath, 40))
	}
	var rep benchkit.GuestReport
	raw, err := os.ReadFile(out)
	if err == nil {
		err = json.Unmarshal(raw, &rep)
	}
	if err != nil {
		return fmt.Errorf("the VM node tier's NFS bench: %w", err)
	}
	for _, r := range rep.Rows {
		b.add(r)
	}
	for k, v := range rep.Figures {
		b.ms["nfs.vm."+k] = v
	}
	fmt.Printf("   (NFS phase: %s, of it %.0f s measuring in the guest; the rest boots the guest and installs dirpv)\n",
		time.Since(t0).Round(time.Second), rep.Seconds)
	return nil
}

// logTail is the last n lines of the log file at path.
func logTail(path string, n int) string {
	log, _ := os.ReadFile(path)
	return vm.LastLines(log, n)
}
