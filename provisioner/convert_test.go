package provisioner

import (
	"bytes"
	"maps"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

func TestConvertClass(t *testing.T) {
	nfs := ConvertTarget{Server: "10.0.0.5", Share: "/srv/nfs"}
	local := ConvertTarget{BasePath: "/opt/local-path-provisioner"}
	nfsParams := func(extra map[string]string) map[string]string {
		p := map[string]string{"backend": "nfs", "server": "10.0.0.5", "share": "/srv/nfs", "pathPattern": DefaultPathPattern, "onDelete": "archive"}
		maps.Copy(p, extra)
		return p
	}
	for _, tc := range []struct {
		name   string
		by     string
		params map[string]string
		mode   storagev1.VolumeBindingMode
		retain bool
		to     ConvertTarget
		want   map[string]string
		err    string
	}{
		{name: "nfs-subdir defaults archive", by: "cluster.local/nfs-subdir-external-provisioner", to: nfs, want: nfsParams(nil)},
		{name: "archiveOnDelete false", by: "cluster.local/nfs-subdir-external-provisioner", params: map[string]string{"archiveOnDelete": "false"}, to: nfs,
			want: nfsParams(map[string]string{"onDelete": "delete"})},
		{name: "onDelete wins", by: "cluster.local/nfs-subdir-external-provisioner", params: map[string]string{"onDelete": "retain", "archiveOnDelete": "false"}, to: nfs,
			want: nfsParams(map[string]string{"onDelete": "retain"})},
		{name: "pathPattern", by: "example.com/nfs", params: map[string]string{"pathPattern": "${.PVC.namespace}/${.PVC.labels.app}-${.PVC.name}/${.PVC.annotations.nfs.io/storage-path}/"}, to: nfs,
			want: nfsParams(map[string]string{"pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.labels['app']}-${pvc.metadata.name}/${pvc.metadata.annotations['nfs.io/storage-path']}"})},
		{name: "unknown pathPattern variable", by: "cluster.local/nfs-subdir-external-provisioner", params: map[string]string{"pathPattern": "${.PV.name}"}, to: nfs, err: "names a variable other than"},
		{name: "bad archiveOnDelete", by: "cluster.local/nfs-subdir-external-provisioner", params: map[string]string{"archiveOnDelete": "maybe"}, to: nfs, err: "archiveOnDelete"},
		{name: "unknown parameter", by: "cluster.local/nfs-subdir-external-provisioner", params: map[string]string{"secret": "x"}, to: nfs, err: `parameters ["secret"] have no dirpv equivalent`},
		{name: "no server", by: "cluster.local/nfs-subdir-external-provisioner", to: ConvertTarget{Share: "/srv"}, err: "NFS_SERVER"},
		{name: "both", by: "example.com/nfs", to: ConvertTarget{Server: "s", Share: "/srv", BasePath: "/opt"}, err: "not both"},
		{name: "local-path under another name", by: "example.com/local", mode: storagev1.VolumeBindingWaitForFirstConsumer, to: local,
			want: map[string]string{"backend": "local", "basePath": "/opt/local-path-provisioner", "onDelete": "delete",
				"pathPattern": "${pv.metadata.name}_${pvc.metadata.namespace}_${pvc.metadata.name}"}},
		{name: "local-path", by: "rancher.io/local-path", mode: storagev1.VolumeBindingWaitForFirstConsumer, to: local,
			want: map[string]string{"backend": "local", "basePath": "/opt/local-path-provisioner", "onDelete": "delete",
				"pathPattern": "${pv.metadata.name}_${pvc.metadata.namespace}_${pvc.metadata.name}"}},
		{name: "local-path retain", by: "rancher.io/local-path", mode: storagev1.VolumeBindingWaitForFirstConsumer, retain: true, to: local,
			want: map[string]string{"backend": "local", "basePath": "/opt/local-path-provisioner", "onDelete": "retain",
				"pathPattern": "${pv.metadata.name}_${pvc.metadata.namespace}_${pvc.metadata.name}"}},
		{name: "local-path Immediate", by: "rancher.io/local-path", mode: storagev1.VolumeBindingImmediate, to: local, err: "WaitForFirstConsumer"},
		{name: "local-path relative base", by: "rancher.io/local-path", mode: storagev1.VolumeBindingWaitForFirstConsumer, to: ConvertTarget{BasePath: "opt"}, err: "would be refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			old := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "old", ResourceVersion: "7",
				Annotations: map[string]string{"storageclass.kubernetes.io/is-default-class": "true", "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
				Provisioner: tc.by, Parameters: tc.params, MountOptions: []string{"nfsvers=4.1"}}
			if tc.mode != "" {
				old.VolumeBindingMode = &tc.mode
			}
			if tc.retain {
				old.ReclaimPolicy = ptr.To(v1.PersistentVolumeReclaimRetain)
			}
			got, err := ConvertClass(old, tc.to, testDriver)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want one containing %q", err, tc.err)
				}
				return
			}
			must(t, err)
			if !maps.Equal(got.Parameters, tc.want) {
				t.Errorf("parameters %v, want %v", got.Parameters, tc.want)
			}
			if got.Name != "old" || got.Provisioner != testDriver || got.ResourceVersion != "" || len(got.Annotations) != 1 ||
				got.Annotations["storageclass.kubernetes.io/is-default-class"] != "true" || got.MountOptions[0] != "nfsvers=4.1" {
				t.Errorf("class %+v: want the old name, dirpv's provisioner, the default-class annotation only, the mount options", got.ObjectMeta)
			}
		})
	}
}

// What `dirpv convert-class` reads and writes: kubectl's YAML.
func TestConvertClassManifest(t *testing.T) {
	in := `apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: nfs-client
  uid: 0c8b7e0e-1c1a-4c1e-9a59-9b2f3f0c8c11
provisioner: cluster.local/nfs-subdir-external-provisioner
parameters:
  archiveOnDelete: "false"
reclaimPolicy: Delete
volumeBindingMode: Immediate
`
	var out bytes.Buffer
	must(t, ConvertClassManifest(strings.NewReader(in), &out, ConvertTarget{Server: "nfs", Share: "/export"}, testDriver))
	var got storagev1.StorageClass
	if err := yaml.UnmarshalStrict(out.Bytes(), &got); err != nil {
		t.Fatalf("%v in:\n%s", err, out.String())
	}
	if got.Kind != "StorageClass" || got.Name != "nfs-client" || got.UID != "" || got.Parameters["onDelete"] != "delete" || got.Parameters["share"] != "/export" {
		t.Errorf("converted:\n%s", out.String())
	}
	if err := ConvertClassManifest(strings.NewReader("kind: ConfigMap\nmetadata: {name: x}\n"), &out, ConvertTarget{}, testDriver); err == nil || !strings.Contains(err.Error(), "want one StorageClass") {
		t.Errorf("a ConfigMap: %v", err)
	}
}
