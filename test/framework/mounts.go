package framework

import (
	"bufio"
	"os"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// MountsUnder lists mount points at or below dir, deepest first, from this host's mount table.
func MountsUnder(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			out = append(out, fields[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(out)))
	return out, s.Err()
}

// DetachMountsUnder lazily unmounts everything at or below dir: what a killed dirpv left behind.
func DetachMountsUnder(dir string) {
	mounts, _ := MountsUnder(dir)
	for _, m := range mounts {
		unix.Unmount(m, unix.MNT_DETACH)
	}
}
