package kernel

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/bench/benchkit"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
)

// The guest's copy rows of `make bench` (issue 23), run by test/bench through vm.RunTest with
// -dirpv.bench-copy: XFS reflink clones of a small and a large source (clone time flat in the
// source's size), and a clone through the kernel NFSv4.2 client against `cp -a` and against
// the tar snapshot of csi-driver-nfs. The figures go to CopyBenchFile in the results.
var (
	benchCopy           = flag.Bool("dirpv.bench-copy", false, "run TestBenchCopy (make bench)")
	benchSmallMiB       = flag.Int("dirpv.bench-reflink-small-mib", 1024, "data in the small reflink source, MiB")
	benchLargeMiB       = flag.Int("dirpv.bench-reflink-large-mib", 8192, "data in the large reflink source, MiB")
	benchReflinkSamples = flag.Int("dirpv.bench-reflink-samples", 5, "clones of each reflink source, the median reported")
	benchTreeScale      = flag.Int("dirpv.bench-nfs-scale", 50, "the NFS tree is the plain-copy tree (1 GiB + 10,000 small + 100,000 empty files) divided by this")
)

// CopyBenchFile is the results file of TestBenchCopy: a benchkit.GuestReport in JSON, of
// seconds, MiB and operation counts by name (test/bench reads it into its rows).
const CopyBenchFile = "copy-bench.json"

func TestBenchCopy(t *testing.T) {
	if !*benchCopy {
		t.Skip("a bench of make bench: -dirpv.bench-copy")
	}
	rep := benchkit.GuestReport{Figures: map[string]float64{}, Notes: map[string]string{}}
	t.Run("nfs", func(t *testing.T) { benchNFSClone(t, &rep) })
	t.Run("xfs-reflink", func(t *testing.T) { benchXFSReflink(t, &rep) })
	raw, err := json.Marshal(rep)
	must(t, err)
	must(t, os.WriteFile(filepath.Join(guest.ResultsDir(), CopyBenchFile), raw, 0o644))
}

// benchXFSReflink clones, with dirpv's copier, a source of a few files holding
// -dirpv.bench-reflink-small-mib of written data (no holes, no unwritten extents) and one
// holding -dirpv.bench-reflink-large-mib, on XFS with reflink. The file system is on a loop
// file in the VM's writable share, a host file: the guest's own tmpfs is in its 2 GiB of RAM.
func benchXFSReflink(t *testing.T, rep *benchkit.GuestReport) {
	small, large := int64(*benchSmallMiB)<<20, int64(*benchLargeMiB)<<20
	scratch, err := os.MkdirTemp(filepath.Dir(guest.ResultsDir()), "bench-xfs-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(scratch) })
	mnt := mountFS(t, scratch, "xfs", small+large+2<<30, "loop")
	r, err := volume.OpenRoot(mnt)
	must(t, err)
	defer r.Close()
	ctx := context.Background()
	rep.Figures["reflink.xfs.samples"] = float64(*benchReflinkSamples)
	for _, s := range []struct {
		key  string
		size int64
	}{{"small", small}, {"large", large}} {
		t0 := time.Now()
		must(t, framework.WriteDataFiles(filepath.Join(mnt, s.key), 4, s.size))
		unix.Sync() // the clone must not pay for writing the source back
		rep.Figures["reflink.xfs."+s.key+".write"] = time.Since(t0).Seconds()
		t.Logf("%d MiB written and synced in %.1fs", s.size>>20, rep.Figures["reflink.xfs."+s.key+".write"])
		rep.Figures["reflink.xfs."+s.key+".extents"] = float64(extents(t, filepath.Join(mnt, s.key)))
		before := usedMiB(t, mnt)
		// Several clones, the median reported: one clone takes tens of milliseconds, which
		// emulation and the other helpers' load on the host move by half.
		var took []float64
		for i := range *benchReflinkSamples {
			name := fmt.Sprintf("%s-clone%d", s.key, i)
			t0 = time.Now()
			_, _, stats, err := r.MkdirAllFrom(ctx, name, volume.Claim{UID: name}, 0, volume.Source{Root: r, Rel: s.key})
			took = append(took, time.Since(t0).Seconds())
			if err != nil {
				t.Fatalf("clone of %s: %v", s.key, err)
			}
			if stats.Method != volume.MethodReflink {
				t.Errorf("clone of %s: method %q, want %q", s.key, stats.Method, volume.MethodReflink)
			}
			unix.Sync()
		}
		rep.Figures["reflink.xfs."+s.key+".mib"] = float64(s.size >> 20)
		rep.Figures["reflink.xfs."+s.key+".clone"] = benchkit.Median(took)
		rep.Figures["reflink.xfs."+s.key+".spaceMiB"] = (usedMiB(t, mnt) - before) / float64(len(took))
		t.Logf("XFS reflink clone of %d MiB in 4 files (%.0f extents): median %.3fs of %.3f (source written in %.1fs), %.1f MiB more used each",
			s.size>>20, rep.Figures["reflink.xfs."+s.key+".extents"], rep.Figures["reflink.xfs."+s.key+".clone"], took,
			rep.Figures["reflink.xfs."+s.key+".write"], rep.Figures["reflink.xfs."+s.key+".spaceMiB"])
	}
}

// extents is how many extents the files in dir hold together, from filefrag (FIEMAP).
func extents(t *testing.T, dir string) int {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*"))
	if err != nil || len(files) == 0 {
		t.Fatalf("files in %s: %v", dir, err)
	}
	out, err := exec.Command("filefrag", files...).CombinedOutput()
	if err != nil {
		t.Fatalf("filefrag: %v: %s", err, out)
	}
	n := 0
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		var e int
		if _, err := fmt.Sscanf(l[strings.LastIndex(l, ": ")+2:], "%d extent", &e); err != nil {
			t.Fatalf("filefrag: %q: %v", l, err)
		}
		n += e
	}
	return n
}

func usedMiB(t *testing.T, dir string) float64 {
	t.Helper()
	mib, err := benchkit.UsedMiB(dir)
	must(t, err)
	return mib
}

// benchNFSClone times, through one NFSv4.2 mount of the guest's kernel client, `cp -a` of a
// tree, dirpv's clone of it, and the tar snapshot and restore of csi-driver-nfs (tar czf of
// the tree to a file on the share, tar xzf of it to a new directory), with the mount's COPY
// operations during each. The export is on the guest's tmpfs.
func benchNFSClone(t *testing.T, rep *benchkit.GuestReport) {
	options := []string{"nfsvers=4.2"}
	serverDir, share := exportFor(t, options, guest.NoRootSquash)
	scale := *benchTreeScale
	must(t, benchkit.FillTree(filepath.Join(serverDir, "src"), 1<<30/int64(scale), 10_000/scale, 100_000/scale))
	r := openExport(t, share, options)
	mnt := r.Path()
	src := filepath.Join(mnt, "src")
	run := func(name string, args ...string) time.Duration {
		t.Helper()
		t0 := time.Now()
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v: %s", name, args, err, out)
		}
		t.Logf("%s %v: %v", name, args, time.Since(t0))
		return time.Since(t0)
	}
	// A first, untimed cp -a brings the source's metadata into the client's caches for both.
	// The copies stay: removing them over NFS under emulation takes as long as making them.
	run("cp", "-a", src, filepath.Join(mnt, "warm"))
	before := nfsOpCounts(t, mnt)
	rep.Figures["nfs.cp"] = run("cp", "-a", src, filepath.Join(mnt, "cp")).Seconds()
	cpOps := opsSince(before, nfsOpCounts(t, mnt))
	rep.Figures["nfs.cp.copyOps"] = float64(cpOps["COPY"])
	t.Logf("cp -a: NFS operations %v", cpOps)

	before = nfsOpCounts(t, mnt)
	t0 := time.Now()
	_, _, stats, err := r.MkdirAllFrom(context.Background(), "clone", volume.Claim{UID: "clone"}, 0, volume.Source{Root: r, Rel: "src"})
	if err != nil {
		t.Fatalf("clone over NFS: %v", err)
	}
	rep.Figures["nfs.clone"] = time.Since(t0).Seconds()
	cloneOps := opsSince(before, nfsOpCounts(t, mnt))
	rep.Figures["nfs.clone.copyOps"] = float64(cloneOps["COPY"])
	t.Logf("dirpv clone: NFS operations %v", cloneOps)
	rep.Notes["nfs.clone.method"] = stats.Method
	t.Logf("dirpv clone: %.1fs", rep.Figures["nfs.clone"])

	tgz := filepath.Join(mnt, "snap.tgz")
	rep.Figures["nfs.tar.c"] = run("tar", "czf", tgz, "-C", src, ".").Seconds()
	must(t, os.Mkdir(filepath.Join(mnt, "restored"), 0o755))
	rep.Figures["nfs.tar.x"] = run("tar", "xzf", tgz, "-C", filepath.Join(mnt, "restored")).Seconds()
	rep.Figures["nfs.scale"] = float64(scale)
	rep.Notes["nfs.tree"] = fmt.Sprintf("%d MiB file + %d files of 4-64 KiB + %d empty files", (1<<30/scale)>>20, 10_000/scale, 100_000/scale)
	t.Logf("NFSv4.2 (%s): cp -a %.1fs (%v COPY), dirpv clone %.1fs (%v COPY, %s), tar czf %.1fs + tar xzf %.1fs",
		rep.Notes["nfs.tree"], rep.Figures["nfs.cp"], rep.Figures["nfs.cp.copyOps"], rep.Figures["nfs.clone"],
		rep.Figures["nfs.clone.copyOps"], stats.Method, rep.Figures["nfs.tar.c"], rep.Figures["nfs.tar.x"])
}
