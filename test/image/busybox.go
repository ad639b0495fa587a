package image

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// BusyboxFiles is a busybox userland from the host's static /bin/busybox (Debian
// busybox-static): the binary, a symlink per applet, /tmp, /root and a root-and-nobody
// /etc/passwd and /etc/group written into tmpDir. Images that need a shell beside their own
// binary start from it.
func BusyboxFiles(ctx context.Context, tmpDir string) ([]File, error) {
	const bb = "/bin/busybox"
	out, err := exec.CommandContext(ctx, bb, "--list-full").Output()
	if err != nil {
		return nil, fmt.Errorf("busybox --list-full: %w", err)
	}
	files := []File{
		{HostPath: bb, ImagePath: "/bin/busybox", Mode: 0o755},
		{ImagePath: "/tmp", Dir: true, Mode: 0o777 | os.ModeSticky},
		{ImagePath: "/root", Dir: true, Mode: 0o700},
	}
	seen := map[string]bool{"/bin/busybox": true}
	for _, l := range strings.Fields(string(out)) {
		p := "/" + strings.TrimPrefix(l, "/")
		if !seen[p] {
			seen[p] = true
			files = append(files, File{ImagePath: p, Symlink: "/bin/busybox"})
		}
	}
	etc := map[string]string{
		"passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"group":  "root:x:0:\nnogroup:x:65534:\n",
	}
	for name, content := range etc {
		host := filepath.Join(tmpDir, "busybox-"+name)
		if err := os.WriteFile(host, []byte(content), 0o644); err != nil {
			return nil, fmt.Errorf("write %s: %w", host, err)
		}
		files = append(files, File{HostPath: host, ImagePath: "/etc/" + name, Mode: 0o644})
	}
	return files, nil
}
