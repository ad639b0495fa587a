package main

import (
	"flag"
	"fmt"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/framework"
)

// The reflink rows (issue 23): a clone where the file system shares extents costs the same
// whatever the source holds. A clone of a source of a few files holding 8 GiB of written data
// takes at most 1.2x the clone of one holding 1 GiB, and that one under a second: on btrfs here
// (the host's kernel), on XFS in the VM (copyguest.go).
const (
	reflinkFlatGoal     = 1.2
	reflinkSmallGoalSec = 1.0
)

var (
	flagReflinkSmallMiB = flag.Int("reflink-small-mib", 1024, "data in the small source of the reflink rows (btrfs here, XFS in the VM), MiB")
	flagReflinkLargeMiB = flag.Int("reflink-large-mib", 8192, "data in the large source of the reflink rows, MiB")
)

// reflinkFiles is how many files each reflink source spreads its data over.
const reflinkFiles = 4

func (b *bench) reflinkBase() string { return filepath.Join(b.s.Work.Dir, "btrfs-reflink") }

// mountReflinkBase mounts copyReflink's btrfs (no quota: each volume a directory, so that a
// clone is the copier's FICLONE of every file, not a subvolume snapshot) before dirpv starts.
// Its image is sparse and takes the sources' data, written, and the clones' metadata.
func (b *bench) mountReflinkBase() error {
	size := int64(*flagReflinkSmallMiB+*flagReflinkLargeMiB)<<20 + 4<<30
	return b.s.MountBtrfs(b.reflinkBase(), size, false)
}

// copyReflink binds a small and a large source claim on the btrfs base, writes their data
// (then syncs, so that a clone does not pay for writing its source back), and clones each
// through dirpv, timed create->Bound, with the space the clone took (statfs, after a sync).
func (b *bench) copyReflink() error {
	base := b.reflinkBase()
	for _, s := range []struct {
		key string
		mib int
	}{{"small", *flagReflinkSmallMiB}, {"large", *flagReflinkLargeMiB}} {
		ns, class := "copy-reflink-"+s.key, "bench-reflink-"+s.key
		w, src, err := b.copySource(ns, class, base)
		if err != nil {
			return err
		}
		t0 := time.Now()
		if err := framework.WriteDataFiles(src, reflinkFiles, int64(s.mib)<<20); err != nil {
			w.Stop()
			return err
		}
		unix.Sync()
		wrote := time.Since(t0)
		before, err := benchkit.UsedMiB(base)
		if err != nil {
			w.Stop()
			return err
		}
		took, err := b.clone(w, ns, class)
		w.Stop()
		if err != nil {
			return err
		}
		unix.Sync()
		after, err := benchkit.UsedMiB(base)
		if err != nil {
			return err
		}
		b.ms["copy.reflink.btrfs."+s.key] = took.Seconds()
		b.ms["copy.reflink.btrfs."+s.key+".space"] = after - before
		fmt.Printf("   (btrfs: %d MiB in %d files written and synced in %.1fs; clone create->Bound %.3fs, %.1f MiB more used after it)\n",
			s.mib, reflinkFiles, wrote.Seconds(), took.Seconds(), after-before)
	}
	small, large := b.ms["copy.reflink.btrfs.small"], b.ms["copy.reflink.btrfs.large"]
	// In ms: a clone that shares extents takes tens of them, the API round trips mostly.
	b.add(Row{Name: fmt.Sprintf("dirpv clone, %d MiB in %d files (btrfs reflink), create->Bound", *flagReflinkSmallMiB, reflinkFiles),
		Value: small * 1000, Unit: "ms", Ref: fmt.Sprintf("goal %gs", reflinkSmallGoalSec), RefValue: reflinkSmallGoalSec * 1000})
	b.add(Row{Name: fmt.Sprintf("dirpv clone, %d MiB in %d files (btrfs reflink), create->Bound", *flagReflinkLargeMiB, reflinkFiles),
		Value: large * 1000, Unit: "ms", Ref: fmt.Sprintf("clone of %d MiB", *flagReflinkSmallMiB), RefValue: small * 1000,
		Note: fmt.Sprintf("space used by the clones: %.1f MiB (small), %.1f MiB (large)",
			b.ms["copy.reflink.btrfs.small.space"], b.ms["copy.reflink.btrfs.large.space"])})
	return nil
}
