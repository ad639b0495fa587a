package framework

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// Export stands in for an NFS export where a test checks what dirpv does through the API
// (claims, PVs, events, the directories on the server), not what NFS does: the export is a
// local directory, and mounting server:share/sub bind-mounts it (/sub). NFS itself, through
// the kernel's client and server and real pods, is tested in test/vm.
//
// It takes no test-only flag: dirpv mounts NFS with mount(8) from its PATH (mount-utils'
// mount.New("")), and the dirpv processes a suite starts find a mount wrapper first on theirs
// (Env); everything but an NFS mount of this export goes to the system's mount.
type Export struct {
	// Addr and Share are what a class names: server and share.
	Addr, Share string
	// ExportDir is the export's directory, the server's side of it.
	ExportDir string
	bin       string
}

// mountWrapper is mount(8) for the dirpv processes of a suite. mount-utils runs
// `mount [-t TYPE] [-o OPTIONS] SOURCE TARGET` for a Mount (systemd-run first only where
// systemd is PID 1, which runs mount from the same PATH). An nfs or nfs4 mount of an export in
// ./exports (lines SOURCE<tab>DIR) becomes a bind mount of DIR (+ /sub), read-only with "ro",
// its type, source and options recorded in ./mounts/<sha256 of TARGET> before it is made; any
// other mount(8) call goes to the system's.
const mountWrapper = `#!/bin/sh
# Written by test/framework (export.go); see mountWrapper there.
here=${0%/*}
if [ $# -lt 4 ] || [ "$1" != -t ] || { [ "$2" != nfs ] && [ "$2" != nfs4 ]; }; then
	exec /bin/mount "$@"
fi
fstype=$2
shift 2
opts=
if [ "$1" = -o ]; then
	opts=$2
	shift 2
fi
if [ $# -ne 2 ]; then
	echo "mount (test wrapper): want SOURCE TARGET after -t and -o, got: $*" >&2
	exit 1
fi
src=$1 tgt=$2
while IFS='	' read -r exp dir; do
	case $src in
	"$exp") sub= ;;
	"$exp"/*) sub=${src#"$exp"} ;;
	*) continue ;;
	esac
	case $sub/ in
	*/../* | */./* | *//*)
		echo "mount.nfs (test wrapper): $src is not a clean path" >&2
		exit 32
		;;
	esac
	ro=
	case ,$opts, in *,ro,*) ro=-r ;; esac
	rec=$here/mounts/$(printf %s "$tgt" | sha256sum | cut -d' ' -f1)
	printf '%s\n%s\n%s\n' "$fstype" "$src" "$opts" >"$rec.tmp" && mv "$rec.tmp" "$rec" || exit 32
	exec /bin/mount --bind $ro "$dir$sub" "$tgt"
done <"$here/exports"
echo "mount.nfs (test wrapper): access denied by server while mounting $src (no such export)" >&2
exit 32
`

// NewExport makes the workspace's export directory and the mount wrapper, in w.Dir/bin.
func NewExport(w *Workspace) (*Export, error) {
	e := &Export{Addr: "127.0.0.1", Share: "/export", ExportDir: filepath.Join(w.Dir, "export"), bin: filepath.Join(w.Dir, "bin")}
	// World-writable, as an export for pods of any user is.
	for _, d := range []string{e.ExportDir, filepath.Join(e.bin, "mounts")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := os.Chmod(e.ExportDir, 0o777); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(e.bin, "exports"), []byte(e.Source("")+"\t"+e.ExportDir+"\n"), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(e.bin, "mount"), []byte(mountWrapper), 0o755); err != nil {
		return nil, err
	}
	return e, nil
}

// Env is the environment a dirpv process needs to mount the export: PATH with the wrapper first.
func (e *Export) Env() []string {
	return []string{"PATH=" + e.bin + string(os.PathListSeparator) + os.Getenv("PATH")}
}

// Source is the mount source of rel (relative to the share; "" for the share itself), as
// dirpv names it (volume.ExportSource; Addr is no IPv6 address).
func (e *Export) Source(rel string) string {
	return e.Addr + ":" + path.Join(e.Share, rel)
}

// ExportMount is a live mount the wrapper made, as dirpv asked for it.
type ExportMount struct {
	Dir, FSType, Source string
	Options             []string
}

// MountsUnder lists the live mounts at or below dir that the wrapper made, deepest first.
func (e *Export) MountsUnder(dir string) ([]ExportMount, error) {
	infos, err := MountInfosUnder(dir)
	if err != nil {
		return nil, err
	}
	var out []ExportMount
	for _, mi := range infos {
		sum := sha256.Sum256([]byte(mi.MountPoint))
		rec, err := os.ReadFile(filepath.Join(e.bin, "mounts", hex.EncodeToString(sum[:])))
		if errors.Is(err, os.ErrNotExist) {
			continue
		} else if err != nil {
			return nil, err
		}
		lines := strings.Split(strings.TrimSuffix(string(rec), "\n"), "\n")
		if len(lines) != 3 {
			return nil, fmt.Errorf("mount record of %s: %d lines", mi.MountPoint, len(lines))
		}
		m := ExportMount{Dir: mi.MountPoint, FSType: lines[0], Source: lines[1]}
		if lines[2] != "" {
			m.Options = strings.Split(lines[2], ",")
		}
		out = append(out, m)
	}
	return out, nil
}
