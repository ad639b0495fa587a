package volume

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

// benchTree fills dir with 10k small files in 100 directories and 4 files of 16 MiB, and
// returns the bytes and entries it holds.
func benchTree(b *testing.B, dir string) (bytes int64, entries int) {
	small := make([]byte, 2048)
	for d := 0; d < 100; d++ {
		sub := filepath.Join(dir, fmt.Sprintf("d%02d", d))
		must(b, os.Mkdir(sub, 0o755))
		for f := 0; f < 100; f++ {
			small[0] = byte(f)
			must(b, os.WriteFile(filepath.Join(sub, fmt.Sprint(f)), small, 0o644))
		}
	}
	large := make([]byte, 16<<20)
	for i := range large {
		large[i] = byte(i * 31)
	}
	for f := 0; f < 4; f++ {
		must(b, os.WriteFile(filepath.Join(dir, fmt.Sprint("large", f)), large, 0o644))
	}
	return 100*100*2048 + 4*16<<20, 100 + 100*100 + 4
}

// BenchmarkCopy compares MkdirAllFrom with cp -a of the same tree (10k small files, 4 large
// ones) on tmpfs and on btrfs (plain directories: reflinks for both; a limited volume: a
// btrfs snapshot for dirpv). It reports bytes/s and entries/s.
//
//	go test -run '^$' -bench BenchmarkCopy ./volume/
func BenchmarkCopy(b *testing.B) {
	tmpfs := b.TempDir()
	must(b, unix.Mount("tmpfs", tmpfs, "tmpfs", 0, "size=1g"))
	b.Cleanup(func() { unix.Unmount(tmpfs, unix.MNT_DETACH) })
	// A file system each: 256 MiB hold one source and its copies, not two.
	for _, fs := range []struct {
		name, base string
		limit      uint64
	}{
		{"tmpfs", tmpfs, 0},
		{"btrfs", quotatest.Btrfs(b, true), 0},
		{"btrfs-subvolume", quotatest.Btrfs(b, true), 512 << 20},
	} {
		r, err := OpenRoot(fs.base)
		must(b, err)
		defer r.Close()
		src := "src-" + fs.name
		if fs.limit > 0 {
			_, _, err = r.MkdirAllLimited(src, Owner{Mode: 0o755}, Claim{UID: src}, fs.limit)
		} else {
			_, err = r.MkdirAll(src, Owner{Mode: 0o755}, Claim{UID: src})
		}
		must(b, err)
		bytes, entries := benchTree(b, filepath.Join(fs.base, src))
		run := func(name string, copy func(dst string) (string, error)) {
			b.Run(fs.name+"/"+name, func(b *testing.B) {
				b.SetBytes(bytes)
				method := ""
				for i := 0; i < b.N; i++ {
					dst := fmt.Sprintf("%s-%s-%d", src, name, i)
					b.StartTimer()
					m, err := copy(dst)
					b.StopTimer()
					if err != nil {
						b.Fatal(err)
					}
					method = m
					if fs.limit > 0 {
						must(b, r.RemoveAll(dst))
					} else {
						must(b, os.RemoveAll(filepath.Join(fs.base, dst)))
					}
				}
				b.ReportMetric(float64(entries)*float64(b.N)/b.Elapsed().Seconds(), "entries/s")
				if method != "" {
					b.Logf("method %s", method)
				}
			})
		}
		run("dirpv", func(dst string) (string, error) {
			_, _, stats, err := r.MkdirAllFrom(context.Background(), dst, Claim{UID: dst}, fs.limit, Source{Root: r, Rel: src})
			return stats.Method, err
		})
		run("cp-a", func(dst string) (string, error) {
			out, err := exec.Command("cp", "-a", filepath.Join(fs.base, src), filepath.Join(fs.base, dst)).CombinedOutput()
			if err != nil {
				return "", fmt.Errorf("cp -a: %w\n%s", err, out)
			}
			return "", nil
		})
	}
}
