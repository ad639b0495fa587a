package provisioner

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Classes the node cannot serve get an error and publish nothing: a class the parser refuses
// or an NFS class is InvalidArgument, a base outside the allowed ones PermissionDenied, and a
// base reached through a symlink is refused without anything made or followed.
func TestGetCapacityRefusals(t *testing.T) {
	f := newFixture(t)
	outside := t.TempDir()
	must(t, os.Symlink(outside, filepath.Join(f.base, "link")))
	for name, tc := range map[string]struct {
		params map[string]string
		want   codes.Code
		ctrl   bool
	}{
		// The controller does not speak for local classes.
		"local class, controller": {map[string]string{"backend": "local", "basePath": f.base}, codes.InvalidArgument, true},
		"unknown parameter":       {map[string]string{"backend": "local", "basePath": f.base, "sizeLimit": "1"}, codes.InvalidArgument, false},
		"no backend":              {map[string]string{"basePath": f.base}, codes.InvalidArgument, false},
		"nfs class":               {map[string]string{"backend": "nfs", "server": "srv", "share": "/export"}, codes.InvalidArgument, false},
		"base not allowed":        {map[string]string{"backend": "local", "basePath": "/srv/elsewhere"}, codes.PermissionDenied, false},
		"symlinked base":          {map[string]string{"backend": "local", "basePath": filepath.Join(f.base, "link", "base")}, codes.FailedPrecondition, false},
	} {
		t.Run(name, func(t *testing.T) {
			p := f.node
			if tc.ctrl {
				p = f.ctrl
			}
			resp, err := p.GetCapacity(context.Background(), &csi.GetCapacityRequest{Parameters: tc.params})
			if status.Code(err) != tc.want {
				t.Errorf("GetCapacity = %v, %v; want code %s", resp, err, tc.want)
			}
		})
	}
	if got := listTree(t, outside); len(got) != 0 {
		t.Errorf("the symlink's target holds %v, want nothing", got)
	}
	if _, err := os.Stat("/srv/elsewhere"); err == nil {
		t.Error("a base outside the allowed ones was created")
	}
}

func TestPublishesCapacity(t *testing.T) {
	f := newFixture(t)
	wffc, immediate := storagev1.VolumeBindingWaitForFirstConsumer, storagev1.VolumeBindingImmediate
	class := func(backend string, mode *storagev1.VolumeBindingMode, provisioner string) *storagev1.StorageClass {
		return &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "c"}, Provisioner: provisioner,
			Parameters: map[string]string{"backend": backend}, VolumeBindingMode: mode}
	}
	for _, tc := range []struct {
		class      *storagev1.StorageClass
		node, ctrl bool
	}{
		{class("local", &wffc, testDriver), true, false},
		{class("nfs", &wffc, testDriver), false, true},
		{class("nfs", &immediate, testDriver), false, false},
		{class("nfs", nil, testDriver), false, false},
		{class("local", &wffc, "other.io"), false, false},
		{class("", &wffc, testDriver), false, true},
	} {
		if got := f.node.PublishesCapacity(tc.class); got != tc.node {
			t.Errorf("node publishes %s %v %s: %v, want %v", tc.class.Parameters["backend"], tc.class.VolumeBindingMode, tc.class.Provisioner, got, tc.node)
		}
		if got := f.ctrl.PublishesCapacity(tc.class); got != tc.ctrl {
			t.Errorf("controller publishes %s %v %s: %v, want %v", tc.class.Parameters["backend"], tc.class.VolumeBindingMode, tc.class.Provisioner, got, tc.ctrl)
		}
	}
}

func TestRoundCapacity(t *testing.T) {
	for _, tc := range []struct{ in, want uint64 }{
		{0, 0},
		{1<<20 - 1, 0},
		{5<<20 + 12345, 5 << 20},
		{64 << 20, 64 << 20},
		{127<<20 + 1, 127 << 20},
		{1<<40 + 15<<30, 1 << 40},
		{61<<30 + 123456789, 61 << 30},
	} {
		got := roundCapacity(tc.in)
		if got != tc.want {
			t.Errorf("roundCapacity(%d) = %d, want %d", tc.in, got, tc.want)
		}
		if got > tc.in || (tc.in >= 64<<20 && tc.in-got > tc.in/64) {
			t.Errorf("roundCapacity(%d) = %d: more than there is, or off by more than 1/64", tc.in, got)
		}
	}
}
