package install

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// describeTree is a busybox script that prints one line per entry under /data, sorted: name,
// type, mode, owner, link count, size, mtime, symlink target and content hash; what a user
// compares between a volume and its clone.
const describeTree = `cd /data && find . | sort | while read -r f; do
  l="$(stat -c '%n %F %a %u:%g %h %s %Y' "$f")"
  if [ -L "$f" ]; then l="$l -> $(readlink "$f")"; elif [ -f "$f" ]; then l="$l $(md5sum < "$f" | cut -d' ' -f1)"; fi
  echo "$l"
done`

// A pod writes a tree with every kind of entry into a claim on a btrfs base; a clone's pod
// sees the same tree, the symlink's target outside the volume is untouched, and the clone,
// on btrfs, is a snapshot of the source's subvolume.
func TestCloneSeesSameTree(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	capacityClass(t, "install-clone")
	outside := filepath.Join(basePath, "install-clone-outside")
	must(t, os.MkdirAll(outside, 0o755))
	t.Cleanup(func() { os.RemoveAll(outside) })
	must(t, os.WriteFile(filepath.Join(outside, "target"), []byte("outside\n"), 0o600))
	before, err := framework.SnapshotTree(outside, nil)
	must(t, err)
	suite.CreateClaim(t, ns, "src", "install-clone", framework.Request("1Gi"))
	write := `set -e; cd /data
echo hello > a.txt; chown 1234:5678 a.txt; chmod 640 a.txt
ln a.txt hard; mkdir sub; chmod 1777 sub; ln a.txt sub/hard2
printf '#!/bin/sh\n' > sub/setuid; chmod 4751 sub/setuid
dd if=/dev/zero of=sparse bs=1M count=1 seek=512 2>/dev/null
ln -s ` + filepath.Join(outside, "target") + ` out; ln -s ../../../etc/passwd sub/up
mkfifo fifo; touch -d '2020-01-02 03:04:05' a.txt; sync
` + describeTree
	suite.CreatePod(t, suite.BusyboxPod(ns, "writer", "src", write, false))
	want := podDone(t, ns, "writer")
	srcDir := volumeDir(t, ns, "src")
	// busybox has no setfattr: the xattr is set from the host, as a tool in a pod would.
	must(t, unix.Lsetxattr(filepath.Join(srcDir, "a.txt"), "user.dirpv-test", []byte("kept"), 0))

	suite.CreateClaim(t, ns, "copy", "install-clone", framework.Request("1Gi"), func(c *v1.PersistentVolumeClaim) {
		c.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "src"}
	})
	suite.CreatePod(t, suite.BusyboxPod(ns, "reader", "copy", describeTree, false))
	got := podDone(t, ns, "reader")
	if got != want || !strings.Contains(want, "./sparse regular file") {
		t.Errorf("the clone's pod sees\n%s\nthe source's pod saw\n%s", got, want)
	}
	cloneDir := volumeDir(t, ns, "copy")
	// What the pods cannot see: extended attributes, hard-link groups, nanosecond mtimes.
	wantHash, err := framework.TreeHash(srcDir)
	must(t, err)
	gotHash, err := framework.TreeHash(cloneDir)
	must(t, err)
	if d := framework.DiffSnapshots(wantHash, gotHash); len(d) > 0 {
		t.Errorf("the clone on the node differs from its source:\n%s", strings.Join(d, "\n"))
	}
	buf := make([]byte, 16)
	if n, err := unix.Lgetxattr(filepath.Join(cloneDir, "a.txt"), "user.dirpv-test", buf); err != nil || string(buf[:n]) != "kept" {
		t.Errorf("xattr in the clone: %q, %v", buf[:max(n, 0)], err)
	}
	after, err := framework.SnapshotTree(outside, nil)
	must(t, err)
	if d := framework.DiffSnapshots(before, after); len(d) > 0 {
		t.Errorf("the symlink's target outside changed: %v", d)
	}
	var st unix.Stat_t
	if err := unix.Lstat(cloneDir, &st); err != nil || st.Ino != 256 {
		t.Errorf("clone directory inode %d (%v): want a btrfs subvolume (256)", st.Ino, err)
	}
	// The node plugin's log says how the tree was copied: on a btrfs base whose volumes are
	// subvolumes, by snapshot.
	plugin, _ := nodePlugin(ctx, t)
	logs, err := suite.Client.CoreV1().Pods("dirpv").GetLogs(plugin.Name, &v1.PodLogOptions{Container: "dirpv"}).DoRaw(ctx)
	must(t, err)
	var copied string
	for _, l := range strings.Split(string(logs), "\n") {
		if strings.Contains(l, "Copied data source into the new volume") && strings.Contains(l, ns+"/src") {
			copied = l
		}
	}
	t.Logf("node plugin: %s", copied)
	if !strings.Contains(copied, "by btrfs-snapshot") {
		t.Errorf("the clone on btrfs was not made by a btrfs snapshot: %q", copied)
	}
}
