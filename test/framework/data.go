package framework

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
)

// WriteDataFiles makes dir with n files data0... that hold size bytes of data together, each
// written in full: no holes and no preallocated (unwritten) extents, so that a copy or a clone
// of them has every byte to copy or share. The data is random, as incompressible to gzip as
// media, archives and compressed binaries are: a copy that compresses, such as the tar.gz
// snapshots of csi-driver-nfs, must not be flattered by data it can shrink to nothing.
func WriteDataFiles(dir string, n int, size int64) error {
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		return err
	}
	// 4 MiB of random bytes, repeated: a repeat lies far beyond gzip's 32 KiB window, so gzip
	// finds nothing to shrink (a compressor with a window of 4 MiB or more would find the
	// repeats; generating every byte would cost the 8 GiB reflink source a minute under
	// emulation).
	buf := make([]byte, 4<<20)
	_, _ = rand.NewChaCha8([32]byte{1}).Read(buf) // never fails
	for i := range n {
		f, err := os.Create(filepath.Join(dir, fmt.Sprintf("data%d", i)))
		if err != nil {
			return err
		}
		for left := size / int64(n); left > 0; left -= int64(len(buf)) {
			buf[0] = byte(left >> 22) // no two blocks alike, should anything deduplicate
			if _, err := f.Write(buf[:min(left, int64(len(buf)))]); err != nil {
				f.Close()
				return err
			}
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	return nil
}
