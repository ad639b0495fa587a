package kernel

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota"
)

// quotaFS makes a file system (sparse, 320 MiB: mkfs.xfs wants more than 300 MB) of fstype on a loop file with project quota on and
// returns its mount point.
func quotaFS(t *testing.T, fstype string) string {
	t.Helper()
	dir := t.TempDir()
	img := filepath.Join(dir, fstype+".img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 320<<20); err != nil {
		t.Fatal(err)
	}
	switch fstype {
	case "xfs":
		runCmd(t, "mkfs.xfs", "-q", img)
	case "ext4":
		runCmd(t, "mkfs.ext4", "-q", "-O", "quota,project", img)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	runCmd(t, "mount", "-t", fstype, "-o", "loop,prjquota", img, mnt)
	t.Cleanup(func() {
		if out, err := exec.Command("umount", "-d", mnt).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v\n%s", mnt, err, out)
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
	if err != nil {
		t.Fatal(err)
	}
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

// TestQuotaProjectLimits: on XFS and ext4 mounted with prjquota, a volume given a 10 MiB
// limit stops a tenant's write at 10 MiB with EDQUOT, statfs of the volume reports 10 MiB, a
// neighbour on the same file system is unaffected, and usage reads back from the quota.
func TestQuotaProjectLimits(t *testing.T) {
	for _, fstype := range []string{"xfs", "ext4"} {
		t.Run(fstype, func(t *testing.T) {
			mnt := quotaFS(t, fstype)
			base := dirFd(t, mnt)
			fs, err := quota.Probe(base)
			if err != nil {
				t.Fatal(err)
			}
			if err := fs.Enforces(); err != nil || fs.Kind() != quota.Project {
				t.Fatalf("%s with prjquota: Kind %q, Enforces %v", fstype, fs.Kind(), err)
			}
			const limit = 10 << 20
			ids := map[string]quota.ID{}
			for _, name := range []string{"a", "b"} {
				if err := fs.Mkdir(base, name, 0o777); err != nil {
					t.Fatal(err)
				}
				fd := dirFd(t, filepath.Join(mnt, name))
				if err := unix.Fchmod(fd, 0o777); err != nil {
					t.Fatal(err)
				}
				id, err := fs.SetLimit(fd, limit)
				if err != nil {
					t.Fatal(err)
				}
				var st unix.Stat_t
				if err := unix.Fstat(fd, &st); err != nil {
					t.Fatal(err)
				}
				if id.Num != st.Ino {
					t.Errorf("volume %s (inode %d) got project %v, want its inode number", name, st.Ino, id)
				}
				ids[name] = id
			}
			if ids["a"] == ids["b"] {
				t.Fatalf("two volumes share quota ID %v", ids["a"])
			}

			var sfs unix.Statfs_t
			if err := unix.Statfs(filepath.Join(mnt, "a"), &sfs); err != nil {
				t.Fatal(err)
			}
			if got := sfs.Blocks * uint64(sfs.Bsize); got != limit {
				t.Errorf("statfs of the volume reports size %d, want the limit %d", got, limit)
			}

			failed, out := writeAsTenant(t, filepath.Join(mnt, "a", "big"), 20)
			if !failed || !strings.Contains(out, "quota exceeded") {
				t.Errorf("writing 20 MiB into a 10 MiB volume: failed %v, dd said %q; want Disk quota exceeded", failed, out)
			}
			if fi, err := os.Stat(filepath.Join(mnt, "a", "big")); err != nil || fi.Size() > limit {
				t.Errorf("file in the full volume: %v, %v; want at most %d bytes", fi.Size(), err, limit)
			}
			if failed, out := writeAsTenant(t, filepath.Join(mnt, "b", "file"), 8); failed {
				t.Errorf("neighbour volume: 8 MiB write failed: %s", out)
			}
			u, err := fs.Usage(base, ids["b"])
			if err != nil {
				t.Fatal(err)
			}
			if u.LimitBytes != limit || u.UsedBytes < 8<<20 || u.UsedBytes > 9<<20 || !u.HasInodes || u.UsedInodes != 2 {
				t.Errorf("neighbour holding one 8 MiB file: usage %+v; want limit %d, ~8 MiB and 2 inodes used", u, limit)
			}

			if err := os.RemoveAll(filepath.Join(mnt, "b")); err != nil {
				t.Fatal(err)
			}
			if err := fs.Release(base, ids["b"]); err != nil {
				t.Fatal(err)
			}
			if u, err := fs.Usage(base, ids["b"]); err == nil && u.LimitBytes != 0 {
				t.Errorf("released project still has limit %d", u.LimitBytes)
			} else if err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ESRCH) {
				t.Errorf("reading a released project: %v", err)
			}
		})
	}
}
