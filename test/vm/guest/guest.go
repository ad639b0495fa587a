// Package guest is for code that runs inside the test VM of package vm: test binaries that
// package vm boots with the host's root. It starts the guest's kernel NFS server on its
// loopback and can stop and restart it to simulate a dead server.
//
// A test package meant for the guest calls Main from its TestMain, so that running it on the
// host fails with a message instead of testing the host's kernel:
//
//	func TestMain(m *testing.M) { guest.Main(m) }
package guest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// InVM reports whether this process runs inside the test VM (package vm sets DIRPV_IN_VM).
func InVM() bool { return os.Getenv("DIRPV_IN_VM") == "1" }

// Main runs the tests if this process is inside the test VM and fails otherwise: these tests
// need the guest's kernel (NFS client and server, loop devices, quotas), never the host's.
func Main(m *testing.M) {
	if !InVM() {
		fmt.Fprintln(os.Stderr, "FAIL: these tests run inside the test VM (DIRPV_IN_VM is not set): use `make test-vm` or `go run ./test/vm/cmd/dirpv-vm test PKG`")
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// ResultsDir is where a guest process leaves files for the host (vm.Result.Files).
func ResultsDir() string { return os.Getenv("DIRPV_VM_RESULTS") }

// StopRequested reports whether the host has asked the guest command to end (vm.Machine.Stop),
// for a command that runs until then, such as a Kubernetes node.
func StopRequested() bool {
	f := os.Getenv("DIRPV_VM_STOP")
	if f == "" {
		return false
	}
	_, err := os.Stat(f)
	return err == nil
}

// run runs a command with a deadline and returns its combined output in the error.
func run(ctx context.Context, timeout time.Duration, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w\n%s", name, strings.Join(args, " "), err, out)
	}
	return nil
}

// MakeFS makes a file system of fstype in the new sparse image file img of size bytes (XFS
// with mkfs.xfs's defaults, reflink on; ext4 with project quota support) and mounts it at mnt,
// made if missing, with mount's -o options: "loop" and what the caller needs, e.g. prjquota.
func MakeFS(img, mnt, fstype string, size int64, options string) error {
	mkfs := []string{"mkfs.xfs", "-q", img}
	if fstype == "ext4" {
		mkfs = []string{"mkfs.ext4", "-q", "-O", "quota,project", img}
	}
	f, err := os.Create(img)
	if err == nil {
		err = errors.Join(f.Truncate(size), f.Close())
	}
	if err == nil {
		err = os.MkdirAll(mnt, 0o755)
	}
	for _, c := range [][]string{mkfs, {"mount", "-t", fstype, "-o", options, img, mnt}} {
		if err == nil {
			err = run(context.Background(), 5*time.Minute, c[0], c[1:]...)
		}
	}
	if err != nil {
		return fmt.Errorf("%s file system at %s: %w", fstype, mnt, err)
	}
	return nil
}
