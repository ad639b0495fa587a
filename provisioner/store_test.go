package provisioner

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// slowMounter is a FakeMounter whose Mount blocks until release is closed, like mount(8)
// against a server that answers only after the caller's deadline.
type slowMounter struct {
	*mount.FakeMounter
	release chan struct{}
	mounts  atomic.Int32
}

func (m *slowMounter) Mount(source, target, fstype string, options []string) error {
	m.mounts.Add(1)
	<-m.release
	return m.FakeMounter.Mount(source, target, fstype, options)
}

// A mount that completes after its caller gave up is adopted by the next call: neither left
// mounted with an open root nobody closes (which made every later unmount fail with "target is
// busy" on a real NFS mount), nor mounted a second time on top.
func TestLateMountIsAdopted(t *testing.T) {
	m := &slowMounter{FakeMounter: mount.NewFakeMounter(nil), release: make(chan struct{})}
	e := newExports(m, t.TempDir(), 200*time.Millisecond)
	noop := func(*volume.Root) error { return nil }

	err := e.do(context.Background(), "nfs.example", "/export", []string{"nolock"}, noop)
	if !errors.Is(err, errExportUnresponsive) {
		t.Fatalf("first call against a hung mount: %v, want errExportUnresponsive", err)
	}
	// While the abandoned mount is still running, a second call must not start another.
	err = e.do(context.Background(), "nfs.example", "/export", []string{"nolock"}, noop)
	if !errors.Is(err, errExportUnresponsive) {
		t.Fatalf("call while the first mount still runs: %v, want errExportUnresponsive", err)
	}
	close(m.release)
	err = e.do(context.Background(), "nfs.example", "/export", []string{"nolock"}, noop)
	if err != nil {
		t.Fatalf("call after the server answered: %v", err)
	}
	if n := m.mounts.Load(); n != 1 {
		t.Errorf("Mount called %d times, want 1: the late mount should be adopted", n)
	}
	if mps, _ := m.List(); len(mps) != 1 {
		t.Errorf("mounts: %v, want exactly one", mps)
	}
	e.closeAll(context.Background())
}
