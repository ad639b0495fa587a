package kernel

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/vm/guest"
	"github.com/dirpv/dirpv/volume/quota"
)

// quotaFS makes a file system of fstype on a loop file with project quota on and returns its
// mount point.
func quotaFS(t *testing.T, fstype string) string {
	t.Helper()
	return makeFS(t, fstype, "loop,prjquota")
}

// makeFS makes a file system of fstype (sparse, 320 MiB: mkfs.xfs wants more than 300 MB) on
// a loop file and mounts it with options.
func makeFS(t *testing.T, fstype, options string) string {
	t.Helper()
	return mountFS(t, t.TempDir(), fstype, 320<<20, options)
}

// mountFS is makeFS of size bytes with its image in dir, unmounted when the test ends.
func mountFS(t *testing.T, dir, fstype string, size int64, options string) string {
	t.Helper()
	mnt := filepath.Join(dir, "mnt")
	must(t, guest.MakeFS(filepath.Join(dir, fstype+".img"), mnt, fstype, size, options))
	t.Cleanup(func() {
		// An exported file system stays busy a few seconds after its unexport: nfsd's file
		// cache closes the files it kept open in the background.
		err := framework.Poll(context.Background(), 30*time.Second, func(context.Context) (bool, error) {
			out, err := exec.Command("umount", "-d", mnt).CombinedOutput()
			if err != nil {
				return false, fmt.Errorf("umount %s: %v: %s", mnt, err, out)
			}
			return true, nil
		})
		if err != nil {
			// Seen after an NFSv3 export of it (TestNFSOverXFSProjectStatfs) for longer than
			// the wait, cause unknown: detach it, so that the loop device goes once it is free.
			t.Logf("%v: detaching it lazily", err)
			if out, err := exec.Command("umount", "-l", "-d", mnt).CombinedOutput(); err != nil {
				t.Errorf("umount -l %s: %v\n%s", mnt, err, out)
			}
		}
	})
	return mnt
}

func runCmd(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

func dirFd(t *testing.T, p string) int {
	t.Helper()
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	must(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// writeAsTenant writes mib MiB to p as a pod's process would: without CAP_SYS_RESOURCE, which
// ext4 lets bypass quota limits. It returns dd's error output if the write failed.
func writeAsTenant(t *testing.T, p string, mib int) (failed bool, out string) {
	t.Helper()
	cmd := exec.Command("setpriv", "--inh-caps=-sys_resource", "--bounding-set=-sys_resource",
		"dd", "if=/dev/urandom", "of="+p, "bs=1M", "count="+strconv.Itoa(mib), "conv=fsync")
	b, err := cmd.CombinedOutput()
	return err != nil, string(b)
}

// TestQuotaProjectLimits: on XFS and ext4 mounted with prjquota, each volume's project is its
// own (its directory's inode number), usage reads back from the quota with the files counted,
// and a resize raises the volume's own limit only: one naming a neighbour's ID through it is
// refused. That a pod's writes stop at the limit, df shows it, the neighbour is unaffected and
// an online resize lets the same pod write more and see the new size, test/vm/node's
// TestQuotaClaimOnGuestDisk shows with real pods; that a removed volume's project keeps no
// limit, TestQuotaReleaseAfterRemoval.
func TestQuotaProjectLimits(t *testing.T) {
	for _, fstype := range []string{"xfs", "ext4"} {
		t.Run(fstype, func(t *testing.T) {
			mnt := quotaFS(t, fstype)
			base := dirFd(t, mnt)
			fs, err := quota.Probe(base)
			must(t, err)
			if err := fs.Enforces(); err != nil || fs.Kind() != quota.Project {
				t.Fatalf("%s with prjquota: Kind %q, Enforces %v", fstype, fs.Kind(), err)
			}
			const limit = 10 << 20
			ids, fds := map[string]quota.ID{}, map[string]int{}
			for _, name := range []string{"a", "b"} {
				must(t, fs.Mkdir(base, name, 0o777))
				fds[name] = dirFd(t, filepath.Join(mnt, name))
				var st unix.Stat_t
				must(t, unix.Fstat(fds[name], &st))
				id, err := fs.SetLimit(fds[name], limit)
				must(t, err)
				if id.Num != st.Ino { // and so not the neighbour's
					t.Fatalf("volume %s (inode %d) got project %v, want its inode number", name, st.Ino, id)
				}
				ids[name] = id
			}

			if failed, out := writeAsTenant(t, filepath.Join(mnt, "b", "file"), 8); failed {
				t.Fatalf("8 MiB into a 10 MiB volume failed: %s", out)
			}
			u, err := fs.Usage(base, ids["b"])
			must(t, err)
			if u.LimitBytes != limit || u.UsedBytes < 8<<20 || u.UsedBytes > 9<<20 || !u.HasInodes || u.UsedInodes != 2 {
				t.Errorf("volume holding one 8 MiB file: usage %+v; want limit %d, ~8 MiB and 2 inodes used", u, limit)
			}

			if err := fs.Resize(fds["a"], ids["b"], 24<<20); err == nil {
				t.Error("Resize of volume a with b's project ID succeeded, want a refusal")
			}
			must(t, fs.Resize(fds["a"], ids["a"], 24<<20))
			if u, err := fs.Usage(base, ids["a"]); err != nil || u.LimitBytes != 24<<20 {
				t.Errorf("a's limit after its resize: %+v, %v; want %d", u, err, 24<<20)
			}
			if u, err := fs.Usage(base, ids["b"]); err != nil || u.LimitBytes != limit {
				t.Errorf("neighbour's limit after a's resize: %+v, %v; want %d", u, err, limit)
			}
		})
	}
}

// TestQuotaProbeRefuses: file systems that account no project quota, or do not enforce it,
// are reported as unable to enforce, with the fix.
func TestQuotaProbeRefuses(t *testing.T) {
	for _, tc := range []struct{ fstype, options, want string }{
		{"xfs", "loop", "prjquota"},
		{"xfs", "loop,pqnoenforce", "not enforced"},
		{"ext4", "loop", "prjquota"},
	} {
		t.Run(tc.fstype+" "+tc.options, func(t *testing.T) {
			mnt := makeFS(t, tc.fstype, tc.options)
			fs, err := quota.Probe(dirFd(t, mnt))
			must(t, err)
			err = fs.Enforces()
			if !errors.Is(err, quota.ErrNotEnforceable) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Enforces = %v; want ErrNotEnforceable saying %q", err, tc.want)
			}
		})
	}
}

// TestQuotaProjectIDInUseIsSkipped: a project ID that is someone else's is never handed to a
// volume (OpenEBS#359: two volumes sharing a project share a limit): here the new directory's
// inode number, to which a file outside dirpv is charged (chattr -p), or to which an admin
// gave a limit (block or inode, hard or soft) but no files yet. The volume gets another ID,
// and that project's quota is left as it was. Concurrent volumes get distinct IDs.
func TestQuotaProjectIDInUseIsSkipped(t *testing.T) {
	for _, fstype := range []string{"xfs", "ext4"} {
		for _, use := range []string{"file", "bhard=8m", "bsoft=8m", "ihard=100", "isoft=100"} {
			t.Run(fstype+" "+use, func(t *testing.T) {
				mnt := quotaFS(t, fstype)
				base := dirFd(t, mnt)
				fs, err := quota.Probe(base)
				must(t, err)
				must(t, fs.Mkdir(base, "vol", 0o755))
				fd := dirFd(t, filepath.Join(mnt, "vol"))
				var st unix.Stat_t
				must(t, unix.Fstat(fd, &st))
				taken, proj := quota.ID{Kind: quota.Project, Num: st.Ino}, strconv.FormatUint(st.Ino, 10)
				if use == "file" {
					foreign := filepath.Join(mnt, "foreign")
					must(t, os.WriteFile(foreign, nil, 0o644)) // an inode charged, usage that cannot change
					runCmd(t, "chattr", "-p", proj, foreign)
				} else {
					xfsQuota(t, mnt, "limit -p "+use+" "+proj)
				}
				before, err := fs.Usage(base, taken)
				must(t, err)
				id, err := fs.SetLimit(fd, 1<<20)
				must(t, err)
				if id == taken {
					t.Fatalf("volume got project %v, which %s holds", id, use)
				}
				if after, err := fs.Usage(base, taken); err != nil || after != before {
					t.Errorf("project %v: quota %+v (%v) after a volume was made, want it unchanged (%+v)", taken, after, err, before)
				}
				if use != "file" {
					return
				}

				// Concurrent provisioning: every volume its own ID.
				const n = 16
				ids := make(chan quota.ID, n)
				var wg sync.WaitGroup
				for i := range n {
					name := "c" + strconv.Itoa(i)
					must(t, fs.Mkdir(base, name, 0o755))
					fd := dirFd(t, filepath.Join(mnt, name))
					wg.Go(func() {
						id, err := fs.SetLimit(fd, 1<<20)
						if err != nil {
							t.Error(err)
						}
						ids <- id
					})
				}
				wg.Wait()
				close(ids)
				seen := map[quota.ID]bool{id: true}
				for id := range ids {
					if seen[id] {
						t.Errorf("project %v handed out twice", id)
					}
					seen[id] = true
				}
			})
		}
	}
}

// TestQuotaReleaseRacingSetLimit: two bases (two Roots, each with its own quota.FS) on one file
// system. A Delete in base a, retried, releases the project ID of a removed volume while a
// Provision in base b gives that ID to a new volume whose directory reuses the inode (the ID is
// the inode number). However the two interleave, the new volume keeps its limit.
func TestQuotaReleaseRacingSetLimit(t *testing.T) {
	for _, fstype := range []string{"xfs", "ext4"} {
		t.Run(fstype, func(t *testing.T) {
			mnt := quotaFS(t, fstype)
			var fss []*quota.FS
			var bases []int
			for _, name := range []string{"a", "b"} {
				must(t, os.Mkdir(filepath.Join(mnt, name), 0o755))
				fd := dirFd(t, filepath.Join(mnt, name))
				fs, err := quota.Probe(fd)
				must(t, err)
				fss, bases = append(fss, fs), append(bases, fd)
			}
			const limit = 4 << 20
			for i := range 300 {
				name := "v" + strconv.Itoa(i)
				must(t, fss[1].Mkdir(bases[1], name, 0o755))
				fd, err := unix.Open(filepath.Join(mnt, "b", name), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
				must(t, err)
				var st unix.Stat_t
				must(t, unix.Fstat(fd, &st))
				// The ID the new volume asks for first, and the one a's old volume had.
				stale := quota.ID{Kind: quota.Project, Num: st.Ino}
				stop := make(chan struct{})
				var wg sync.WaitGroup
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
						if err := fss[0].Release(bases[0], stale); err != nil {
							t.Error(err)
							return
						}
					}
				})
				id, err := fss[1].SetLimit(fd, limit)
				close(stop)
				wg.Wait()
				unix.Close(fd)
				must(t, err)
				u, err := fss[1].Usage(bases[1], id)
				must(t, err)
				if u.LimitBytes != limit {
					t.Fatalf("iteration %d: volume in project %v (inode %d), with a Release of that ID racing its SetLimit, has limit %d; want %d", i, id, st.Ino, u.LimitBytes, limit)
				}
			}
		})
	}
}
