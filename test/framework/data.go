package framework

import (
	"fmt"
	"os"
	"path/filepath"
)

// WriteDataFiles makes dir with n files data0... that hold size bytes of data together, each
// written in full: no holes and no preallocated (unwritten) extents, so that a copy or a clone
// of them has every byte to copy or share.
func WriteDataFiles(dir string, n int, size int64) error {
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		return err
	}
	buf := make([]byte, 4<<20)
	for i := range buf {
		buf[i] = byte(i*7 + i>>11)
	}
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
