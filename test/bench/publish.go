package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/mount-utils"

	"github.com/dirpv/dirpv/test/bench/benchkit"
)

// publish times NodePublishVolume+NodeUnpublishVolume of a local volume through the node
// plugin's real CSI socket, as kubelet calls them, against a bare bind mount of the same
// directory: mkdir, mount, umount, rmdir, with mount(2) syscalls (the floor) and with
// mount-utils (mount(8), what kubelet and most CSI drivers do).
func (b *bench) publish() error {
	pvcs, err := b.client.CoreV1().PersistentVolumeClaims("local-lat").List(b.ctx, metav1.ListOptions{})
	if err != nil || len(pvcs.Items) == 0 {
		return fmt.Errorf("no local claim to publish: %v", err)
	}
	pv, err := b.client.CoreV1().PersistentVolumes().Get(b.ctx, pvcs.Items[0].Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	attrs := pv.Spec.CSI.VolumeAttributes
	src := filepath.Join(attrs["basePath"], attrs["path"])
	targets := filepath.Join(b.s.Work.Dir, "targets")
	p, err := benchkit.DialPublisher(b.csiSocket(), &csi.NodePublishVolumeRequest{
		VolumeId: pv.Spec.CSI.VolumeHandle, TargetPath: filepath.Join(targets, "csi-target"), VolumeContext: attrs,
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}})
	if err != nil {
		return err
	}
	defer p.Close()
	m := mount.New("")
	const rounds = 5
	ds, err := benchkit.Rounds(rounds, *flagPubN/rounds,
		func() error { return p.Cycle(b.ctx) },
		bareBind(filepath.Join(targets, "bare-syscall"),
			func(target string) error { return unix.Mount(src, target, "", unix.MS_BIND, "") },
			func(target string) error { return unix.Unmount(target, 0) }),
		bareBind(filepath.Join(targets, "bare-mount-utils"),
			func(target string) error { return m.Mount(src, target, "", []string{"bind"}) }, m.Unmount))
	if err != nil {
		return err
	}
	for _, q := range []float64{50, 95} {
		k := fmt.Sprintf("p%.0f", q)
		for i, key := range []string{"pub.", "sys.", "mu."} {
			b.ms[key+k] = benchkit.MS(benchkit.Percentile(ds[i], q))
		}
		b.add(benchkit.Row{Name: "bare bind mount+umount, mount(2) syscalls " + k, Value: b.ms["sys."+k], Unit: "ms"})
		b.add(benchkit.Row{Name: "bare bind mount+umount, mount-utils (mount(8)) " + k, Value: b.ms["mu."+k], Unit: "ms"})
		b.add(benchkit.Row{Name: "dirpv NodePublish+NodeUnpublish (gRPC) " + k, Value: b.ms["pub."+k], Unit: "ms",
			Ref: "mount-utils bind", RefValue: b.ms["mu."+k],
			Note: fmt.Sprintf("%.1fx mount(2) syscalls", b.ms["pub."+k]/b.ms["sys."+k])})
		fmt.Printf("   (%.1fx the bare mount(2) syscalls)\n", b.ms["pub."+k]/b.ms["sys."+k])
	}
	return nil
}

// bareBind is mkdir target, mount (a bind mount), unmount, rmdir.
func bareBind(target string, mount func(target string) error, unmount func(target string) error) func() error {
	return func() error {
		if err := os.Mkdir(target, 0o750); err != nil {
			return err
		}
		if err := mount(target); err != nil {
			return fmt.Errorf("bind mount: %w", err)
		}
		if err := unmount(target); err != nil {
			return fmt.Errorf("unmount: %w", err)
		}
		return os.Remove(target)
	}
}
