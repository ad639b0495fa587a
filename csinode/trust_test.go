package csinode

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/volume"
)

// trustLayout is a host in miniature: kubelet's root with a pod's secret volume in it, the
// allowed base with a tenant's volume, and directories around them that no PV may reach.
//
//	top/kubelet/pods/uid/volumes/secret/token   kubelet's root and a pod's secret
//	top/dirpv/tenant/vol                         the allowed base and a volume in it
//	top/dirpv/tenant/vol/escape -> top/kubelet   a link the tenant planted in its volume
//	top/dirpv2/vol                               a sibling whose name starts like the base
//	top/etc/vol                                  anywhere else
type trustLayout struct {
	top, kubelet, base string
}

func newTrustLayout(t *testing.T) trustLayout {
	t.Helper()
	top := t.TempDir()
	l := trustLayout{top: top, kubelet: filepath.Join(top, "kubelet"), base: filepath.Join(top, "dirpv")}
	for _, d := range []string{"kubelet/pods/uid/volumes/secret", "dirpv/tenant/vol", "dirpv2/vol", "etc/vol"} {
		must(t, os.MkdirAll(filepath.Join(top, d), 0o755))
	}
	must(t, os.WriteFile(filepath.Join(l.kubelet, "pods/uid/volumes/secret/token"), []byte("secret"), 0o600))
	must(t, os.Symlink(l.kubelet, filepath.Join(l.base, "tenant/vol/escape")))
	return l
}

func (l trustLayout) driver(t *testing.T, allowed ...string) *nodeServer {
	_, ns := driverAllowing(t, mount.New(""), 10*time.Second, l.kubelet, allowed...)
	return ns
}

func localAttrs(basePath, rel string) map[string]string {
	return volume.Attributes{Backend: volume.BackendLocal, BasePath: basePath, Path: rel}.Map()
}

// wantRefused checks the code, that the message says each of want, and that nothing was
// mounted or created at the target.
func wantRefused(t *testing.T, err error, code codes.Code, target string, want ...string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v (code %s), want code %s", err, status.Code(err), code)
	}
	msg := status.Convert(err).Message()
	for _, w := range want {
		if !strings.Contains(msg, w) {
			t.Errorf("message %q does not say %q", msg, w)
		}
	}
	if isMounted(t, target) {
		t.Errorf("%s is mounted after a refused publish", target)
	}
	if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("target created for a refused publish: %v", err)
	}
}

// A PV names a directory that exists, or does not, and whose bind mount would work: the allow-
// list, kubelet's root dir, the attributes' checks and the walk from the allowed base that
// follows no symlink (here one a tenant planted in its own volume, pointing at kubelet's root)
// are all that stand between it and the mount. kubelet's root is refused even when an allowed
// base holds it or is it, and so is a CSI inline volume. The base itself and directories
// beneath it are served, with or without the pod's info.
func TestPublishRefusals(t *testing.T) {
	requireRoot(t)
	l := newTrustLayout(t)
	rw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	etc, vol, wide := filepath.Join(l.top, "etc"), filepath.Join(l.base, "tenant/vol"), filepath.Dir(l.top)
	// kubelet passes the pod's info with every volume of a podInfoOnMount driver, and says
	// whether the volume is a CSI inline one.
	podInfo := func(attrs map[string]string, ephemeral string) map[string]string {
		attrs[ephemeralKey], attrs["csi.storage.k8s.io/pod.name"] = ephemeral, "p"
		return attrs
	}
	for name, tc := range map[string]struct {
		allowed string
		attrs   map[string]string
		code    codes.Code
		want    []string
	}{
		"outside every base": {l.base, localAttrs(etc, "vol"), codes.PermissionDenied,
			[]string{"base path " + etc + " is not at or beneath a base path this node allows (" + l.base + ")", "--allowed-base-paths"}},
		"sibling named like the base": {l.base, localAttrs(l.base+"2", "vol"), codes.PermissionDenied, []string{"base path " + l.base + "2 is not at or beneath"}},
		"kubelet's pods":              {l.base, localAttrs(filepath.Join(l.kubelet, "pods"), "uid/volumes/secret"), codes.PermissionDenied, []string{"not at or beneath"}},
		"a pod's secret volume, allowed": {l.top, localAttrs(filepath.Join(l.kubelet, "pods"), "uid/volumes/secret"), codes.PermissionDenied,
			[]string{"is inside kubelet's root dir " + l.kubelet, "secrets"}},
		"kubelet's root itself, allowed": {l.top, localAttrs(l.top, "kubelet"), codes.PermissionDenied, []string{"is inside kubelet's root dir", "secrets"}},
		"kubelet's root in the volume":   {wide, localAttrs(wide, filepath.Base(l.top)), codes.PermissionDenied, []string{"contains kubelet's root dir " + l.kubelet}},
		// Unclean paths never reach the allow-list: the attributes are refused first.
		"unclean base path":          {l.top, map[string]string{"backend": "local", "basePath": l.top + "/dirpv/../kubelet", "path": "pods"}, codes.InvalidArgument, []string{"clean"}},
		"volume is a symlink":        {l.base, localAttrs(vol, "escape"), codes.FailedPrecondition, []string{"symlinks are never followed"}},
		"symlink in the volume path": {l.base, localAttrs(vol, "escape/pods"), codes.FailedPrecondition, []string{"symlinks are never followed"}},
		"symlink in the basePath":    {l.base, localAttrs(filepath.Join(vol, "escape/pods"), "uid/volumes/secret"), codes.FailedPrecondition, []string{"symlinks are never followed"}},
		"missing volume":             {l.base, localAttrs(l.base, "tenant/gone"), codes.NotFound, nil},
		"missing base":               {l.base, localAttrs(filepath.Join(l.base, "gone"), "vol"), codes.NotFound, nil},
		// Even naming an allowed volume: an inline volume's attributes are the pod author's.
		"inline ephemeral": {l.base, podInfo(localAttrs(l.base, "tenant/vol"), "true"), codes.InvalidArgument,
			[]string{"does not serve CSI inline ephemeral volumes", "use a generic ephemeral volume"}},
	} {
		t.Run(name, func(t *testing.T) {
			target := newTarget(t)
			_, err := l.driver(t, tc.allowed).NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
				VolumeId: "v", TargetPath: target, VolumeCapability: rw, VolumeContext: tc.attrs,
			})
			wantRefused(t, err, tc.code, target, tc.want...)
		})
	}

	ns := l.driver(t, l.base)
	for _, attrs := range []map[string]string{localAttrs(l.base, "tenant/vol"), localAttrs(filepath.Join(l.base, "tenant"), "vol"),
		podInfo(localAttrs(l.base, "tenant/vol"), "false")} {
		target := newTarget(t)
		publish(t, ns, &csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: target, VolumeCapability: rw, VolumeContext: attrs})
		if _, err := os.Lstat(filepath.Join(target, "escape")); err != nil {
			t.Errorf("%v: target does not show the volume: %v", attrs, err)
		}
		unpublish(t, ns, "v", target)
	}
}
