package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/vm"
)

// The guest's copy rows (issue 23), measured by test/vm/kernel's TestBenchCopy in the VM:
// XFS reflink clones flat in the source's size (reflinkFlatGoal, reflinkSmallGoalSec), and a
// clone through the kernel NFSv4.2 client at most as long as `cp -a` through the same mount and
// at least 3x faster than csi-driver-nfs's tar snapshot and restore of the same tree.
const (
	nfsCloneCpGoal  = 1.0
	nfsCloneTarGoal = 3.0
)

var flagNFSCopyScale = flag.Int("nfs-copy-scale", 50, "the VM's NFS copy tree is the plain-copy tree (1 GiB + 110k files) divided by this: file operations over NFS under emulation take milliseconds each")

// copyGuest runs TestBenchCopy in the VM (the host's kernel has no NFS client, and XFS project
// quotas and the NFS server want the guest's) and adds its rows. The guest's XFS is on a loop
// file in the VM's share, on the host's disk.
func (b *bench) copyGuest() error {
	ctx, cancel := context.WithTimeout(b.ctx, 90*time.Minute)
	defer cancel()
	img, err := vm.Prepare(ctx, os.Stdout)
	if err != nil {
		return fmt.Errorf("the VM: %w", err)
	}
	logPath := filepath.Join(b.s.Work.LogDir, "copy-vm.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	fmt.Printf("   (VM: test/vm/kernel TestBenchCopy, log %s)\n", logPath)
	res, err := vm.RunTest(ctx, img, vm.GoTest{Package: "github.com/dirpv/dirpv/test/vm/kernel", Timeout: 80 * time.Minute, Output: logf,
		Flags: []string{"-test.run", "^TestBenchCopy$", "-dirpv.bench-copy",
			fmt.Sprintf("-dirpv.bench-reflink-small-mib=%d", *flagReflinkSmallMiB),
			fmt.Sprintf("-dirpv.bench-reflink-large-mib=%d", *flagReflinkLargeMiB),
			fmt.Sprintf("-dirpv.bench-nfs-scale=%d", *flagNFSCopyScale)}})
	if err == nil && res.ExitCode != 0 {
		err = fmt.Errorf("exit status %d", res.ExitCode)
	}
	if err != nil {
		return fmt.Errorf("the VM's copy bench: %w; its log's tail:\n%s", err, logTail(logPath, 30))
	}
	var rep benchkit.GuestReport
	if err := json.Unmarshal(res.Files["copy-bench.json"], &rep); err != nil {
		return fmt.Errorf("the VM's copy bench report: %w", err)
	}
	f := rep.Figures
	for k, v := range f {
		b.ms["copy.vm."+k] = v
	}
	small, large := f["reflink.xfs.small.clone"], f["reflink.xfs.large.clone"]
	b.add(Row{Name: fmt.Sprintf("VM: dirpv clone, %.0f MiB in %d files (XFS reflink)", f["reflink.xfs.small.mib"], reflinkFiles),
		Value: small * 1000, Unit: "ms", Ref: fmt.Sprintf("goal %gs", reflinkSmallGoalSec), RefValue: reflinkSmallGoalSec * 1000,
		Note: fmt.Sprintf("median of %.0f clones; source in %.0f extents; %.1f MiB more used by each",
			f["reflink.xfs.samples"], f["reflink.xfs.small.extents"], f["reflink.xfs.small.spaceMiB"])})
	b.add(Row{Name: fmt.Sprintf("VM: dirpv clone, %.0f MiB in %d files (XFS reflink)", f["reflink.xfs.large.mib"], reflinkFiles),
		Value: large * 1000, Unit: "ms", Ref: fmt.Sprintf("clone of %.0f MiB", f["reflink.xfs.small.mib"]), RefValue: small * 1000,
		Note: fmt.Sprintf("median of %.0f clones; source in %.0f extents, written in %.0fs; %.1f MiB more used by each",
			f["reflink.xfs.samples"], f["reflink.xfs.large.extents"], f["reflink.xfs.large.write"], f["reflink.xfs.large.spaceMiB"])})
	tree := rep.Notes["nfs.tree"]
	clone, tar := f["nfs.clone"], f["nfs.tar.c"]+f["nfs.tar.x"]
	b.add(Row{Name: "VM: dirpv clone over NFSv4.2, " + tree, Value: clone, Unit: "s", Ref: "cp -a", RefValue: f["nfs.cp"],
		Note: fmt.Sprintf("COPY operations: dirpv %.0f, cp -a %.0f; copy method %s", f["nfs.clone.copyOps"], f["nfs.cp.copyOps"], rep.Notes["nfs.clone.method"])})
	b.add(Row{Name: "VM: tar czf + tar xzf over NFSv4.2 (csi-driver-nfs), same tree", Value: tar, Unit: "s", Ref: "dirpv clone", RefValue: clone,
		Note: fmt.Sprintf("tar czf %.1fs, tar xzf %.1fs", f["nfs.tar.c"], f["nfs.tar.x"])})
	return nil
}
