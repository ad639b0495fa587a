package kernel

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/internal/failpoint"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume"
)

// project is one project quota as xfs_quota reports it, in bytes and inodes.
type project struct {
	usedBytes, usedInodes uint64
	// limits holds the soft and hard block and inode limits.
	limits [4]uint64
}

func (p project) limited() bool { return p.limits != [4]uint64{} }

// projects lists every project of the file system at mnt that has files charged to it or a
// limit (xfs_quota leaves out those with neither), project 0 (the files without one) aside.
func projects(t *testing.T, mnt string) map[uint64]project {
	t.Helper()
	out := map[uint64]project{}
	for _, kind := range []string{"-b", "-i"} {
		for _, line := range strings.Split(xfsQuota(t, mnt, "report -p -n -N "+kind), "\n") {
			// #ID used soft hard warn/grace
			f := strings.Fields(line)
			if len(f) < 4 || !strings.HasPrefix(f[0], "#") {
				continue
			}
			id, err := strconv.ParseUint(f[0][1:], 10, 32)
			var n [3]uint64
			for i := range n {
				if err == nil {
					n[i], err = strconv.ParseUint(f[i+1], 10, 64)
				}
			}
			if err != nil {
				t.Fatalf("xfs_quota report line %q: %v", line, err)
			}
			if id == 0 {
				continue
			}
			p := out[id]
			if kind == "-b" {
				p.usedBytes, p.limits[0], p.limits[1] = n[0]<<10, n[1]<<10, n[2]<<10
			} else {
				p.usedInodes, p.limits[2], p.limits[3] = n[0], n[1], n[2]
			}
			out[id] = p
		}
	}
	return out
}

// xfsQuota runs xfs_quota's expert commands cmds on the file system at mnt (ext4 through its
// foreign mode) and returns their output.
func xfsQuota(t *testing.T, mnt string, cmds ...string) string {
	t.Helper()
	args := []string{"-x"}
	var sfs unix.Statfs_t
	must(t, unix.Statfs(mnt, &sfs))
	if uint32(sfs.Type) != unix.XFS_SUPER_MAGIC {
		args = append(args, "-f")
	}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, err := exec.Command("xfs_quota", append(args, mnt)...).CombinedOutput()
	if err != nil {
		t.Fatalf("xfs_quota %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// checkNoLimitedEmptyProject fails for every project of mnt that has a limit but no files: a
// limit nothing clears and no volume can get.
func checkNoLimitedEmptyProject(t *testing.T, mnt string) {
	t.Helper()
	for id, p := range projects(t, mnt) {
		if p.limited() && p.usedBytes == 0 && p.usedInodes == 0 {
			t.Errorf("project %d has limits %v and no files: leaked", id, p.limits)
		}
	}
}

// TestQuotaReleaseAfterRemoval: volumes are provisioned, filled and deleted as dirpv does
// (MkdirAllLimited, RemoveLimited). Once the volume is removed its project has no limit, also
// while the removed files are still charged to it (XFS frees removed inodes in the
// background; a file held open until after the check makes that certain here), and no
// limited project without files remains on the file system.
func TestQuotaReleaseAfterRemoval(t *testing.T) {
	for _, fstype := range []string{"xfs", "ext4"} {
		t.Run(fstype, func(t *testing.T) {
			mnt := quotaFS(t, fstype)
			root, err := volume.OpenRoot(mnt)
			must(t, err)
			defer root.Close()
			fs, err := root.Quota()
			must(t, err)
			const limit = 8 << 20
			for i := range 10 {
				name := "v" + strconv.Itoa(i)
				claim := volume.Claim{UID: "uid-" + name, PVName: "pv-" + name}
				_, id, err := root.MkdirAllLimited(name, volume.Owner{Mode: 0o777, UID: -1, GID: -1}, claim, limit)
				must(t, err)
				if failed, out := writeAsTenant(t, filepath.Join(mnt, name, "data"), 4); failed {
					t.Fatalf("filling volume %s: %s", name, out)
				}
				var held *os.File
				if i == 0 {
					if held, err = os.Open(filepath.Join(mnt, name, "data")); err != nil {
						t.Fatal(err)
					}
				}
				must(t, root.RemoveLimited(name, id))
				u, err := fs.Usage(dirFd(t, mnt), id)
				if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
					t.Fatal(err)
				}
				if u.LimitBytes != 0 {
					t.Errorf("volume %s (project %v) removed: its limit %d is still set (usage %+v, a file held open: %t)",
						name, id, u.LimitBytes, u, held != nil)
				}
				if held != nil {
					if u.UsedInodes == 0 {
						t.Errorf("volume %s: the held file is not charged to its project after the removal (%+v): the check proves nothing", name, u)
					}
					held.Close()
				}
			}
			checkNoLimitedEmptyProject(t, mnt)
		})
	}
}

// crashBaseEnv tells the test binary, started again by TestQuotaCrashLeavesNoLimit, to make
// one volume in the base it names and die at the armed failpoint.
const crashBaseEnv = "DIRPV_VM_CRASH_BASE"

var crashClaim = volume.Claim{UID: "uid-crash", PVName: "pv-crash"}

// TestCrashHelper is the process TestQuotaCrashLeavesNoLimit kills: on its own it does nothing.
func TestCrashHelper(t *testing.T) {
	base := os.Getenv(crashBaseEnv)
	if base == "" {
		t.Skip("started by TestQuotaCrashLeavesNoLimit only")
	}
	root, err := volume.OpenRoot(base)
	must(t, err)
	_, _, err = root.MkdirAllLimited("vol", volume.Owner{Mode: 0o777, UID: -1, GID: -1}, crashClaim, 8<<20)
	t.Fatalf("MkdirAllLimited returned (%v): the failpoint %s did not kill the process", err, os.Getenv(failpoint.Env))
}

// TestQuotaCrashLeavesNoLimit: a process making a limited volume on XFS or ext4 is killed
// (SIGKILL, at a failpoint) after the temporary directory got its project, limit and marker
// and before the rename, or before the limit. The next attempt for the claim makes the volume
// with its limit, and the file system holds one limited project, the volume's: the one the
// crashed attempt limited is cleared. Once the volume is removed, none is left.
func TestQuotaCrashLeavesNoLimit(t *testing.T) {
	self, err := os.Executable()
	must(t, err)
	for _, fstype := range []string{"xfs", "ext4"} {
		for _, point := range []string{failpoint.BeforeLimit, failpoint.BeforeRename} {
			t.Run(fstype+" "+point, func(t *testing.T) {
				mnt := quotaFS(t, fstype)
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				cmd := exec.CommandContext(ctx, self, "-test.run=^TestCrashHelper$", "-test.v")
				cmd.Env = append(os.Environ(), crashBaseEnv+"="+mnt, failpoint.Env+"="+point)
				out, err := cmd.CombinedOutput()
				var exit *exec.ExitError
				if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL ||
					!strings.Contains(string(out), "failpoint "+point+" reached") {
					t.Fatalf("the helper process was not killed at %s: %v\n%s", point, err, out)
				}
				ents := baseEntries(t, mnt)
				if len(ents) != 1 || !strings.HasPrefix(ents[0], volume.ReservedPrefix+"new-") {
					t.Fatalf("base after the crash holds %v, want one temporary directory", ents)
				}
				t.Logf("after the crash at %s: projects %v", point, projects(t, mnt))

				root, err := volume.OpenRoot(mnt)
				must(t, err)
				defer root.Close()
				const limit = 8 << 20
				created, id, err := root.MkdirAllLimited("vol", volume.Owner{Mode: 0o777, UID: -1, GID: -1}, crashClaim, limit)
				if err != nil || !created {
					t.Fatalf("MkdirAllLimited after the crash = %v, %v, %v", created, id, err)
				}
				if ents := baseEntries(t, mnt); len(ents) != 1 || ents[0] != "vol" {
					t.Errorf("base after the retry holds %v, want only the volume", ents)
				}
				limited := map[uint64]project{}
				for n, p := range projects(t, mnt) {
					if p.limited() {
						limited[n] = p
					}
				}
				if p, ok := limited[id.Num]; len(limited) != 1 || !ok || p.limits[1] != limit {
					t.Errorf("limited projects after the retry: %v; want only the volume's (%v) with a hard limit of %d", limited, id, limit)
				}
				if failed, out := writeAsTenant(t, filepath.Join(mnt, "vol", "big"), 16); !failed {
					t.Errorf("16 MiB went into the 8 MiB volume: %s", out)
				}
				must(t, root.RemoveLimited("vol", id))
				for n, p := range projects(t, mnt) {
					if p.limited() {
						t.Errorf("project %d still limited (%+v) once the only volume is gone", n, p)
					}
				}
			})
		}
	}
}

// baseEntries lists the names in the root of the file system at mnt but ext4's lost+found.
func baseEntries(t *testing.T, mnt string) []string {
	t.Helper()
	ents, err := os.ReadDir(mnt)
	must(t, err)
	var out []string
	for _, e := range ents {
		if e.Name() != "lost+found" {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestNFSOverXFSProjectStatfs: an NFS volume dirpv made in a kernel server's export of XFS,
// to which the server's admin gave a project quota (dirpv cannot set one over NFS), is
// published by the node plugin; statfs on the client, and so NodeGetVolumeStats, report the
// project's figures (its limit as the size, its files as used), not the file system's, which a
// neighbour volume without a project reports.
func TestNFSOverXFSProjectStatfs(t *testing.T) {
	for _, options := range [][]string{{"nfsvers=3", "nolock"}, {"nfsvers=4.2", "hard"}} {
		t.Run(strings.Join(options, ","), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			mnt := quotaFS(t, "xfs")
			t.Cleanup(func() {
				// Between the unexport and the unmount: nfsd's export cache still holds the
				// file system after exportfs -ra dropped it.
				if out, err := exec.Command("exportfs", "-f").CombinedOutput(); err != nil {
					t.Errorf("exportfs -f: %v\n%s", err, out)
				}
			})
			serverDir, share := exportDirFor(t, mnt, options, guest.NoRootSquash)
			f := newController(t, time.Minute)
			pv, err := f.provision(ctx, f.nfsClass("nfs", share, options, nil), "quota")
			must(t, err)
			volDir := filepath.Join(serverDir, pv.Spec.CSI.VolumeAttributes["path"])
			const limit, fill = 10 << 20, 4 << 20
			xfsQuota(t, mnt, "project -s -p "+volDir+" 4242", "limit -p bhard=10m 4242")
			if failed, out := writeAsTenant(t, filepath.Join(volDir, "data"), fill>>20); failed {
				t.Fatalf("writing into the volume on the server: %s", out)
			}

			node := nodePlugin(t, 30*time.Second)
			target := filepath.Join(t.TempDir(), "pod")
			if _, err := node.NodePublishVolume(ctx, publishRequest(pv, target, false)); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: pv.Spec.CSI.VolumeHandle, TargetPath: target})
			})
			var sfs, whole unix.Statfs_t
			must(t, unix.Statfs(target, &sfs))
			must(t, unix.Statfs(mnt, &whole))
			size, used := sfs.Blocks*uint64(sfs.Bsize), (sfs.Blocks-sfs.Bfree)*uint64(sfs.Bsize)
			t.Logf("statfs of the NFS-mounted volume (%s): size %d, used %d, avail %d; the XFS file system: size %d",
				strings.Join(options, ","), size, used, sfs.Bavail*uint64(sfs.Bsize), whole.Blocks*uint64(whole.Bsize))
			if size != limit || used < fill || used > fill+1<<20 {
				t.Errorf("statfs of the NFS-mounted volume: size %d, used %d; want the project's: size %d, used about %d", size, used, limit, fill)
			}
			stats, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: pv.Spec.CSI.VolumeHandle, VolumePath: target})
			must(t, err)
			if b := stats.GetUsage()[0]; b.GetTotal() != limit || b.GetUsed() < fill || b.GetUsed() > fill+1<<20 {
				t.Errorf("NodeGetVolumeStats of the NFS volume: %+v; want total %d, used about %d", b, limit, fill)
			}

			// A neighbour without a project reports the exported file system.
			plain, err := f.provision(ctx, f.nfsClass("nfs-plain", share, options, nil), "plain")
			must(t, err)
			plainTarget := filepath.Join(t.TempDir(), "pod")
			if _, err := node.NodePublishVolume(ctx, publishRequest(plain, plainTarget, false)); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: plain.Spec.CSI.VolumeHandle, TargetPath: plainTarget})
			})
			must(t, unix.Statfs(plainTarget, &sfs))
			if got, want := sfs.Blocks*uint64(sfs.Bsize), whole.Blocks*uint64(whole.Bsize); got+1<<20 < want || got > want+1<<20 {
				t.Errorf("statfs of an NFS volume without a project: size %d; want the file system's, %d", got, want)
			}
		})
	}
}
