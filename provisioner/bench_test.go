package provisioner

// Benchmarks of the per-claim paths that need no cluster: go test -run '^$' -bench . ./provisioner
// The cluster-level figures (create->Bound against the binding ceiling, publish, RSS) come from
// go run ./test/bench.

import (
	"context"
	"fmt"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/volume"
	"github.com/dirpv/dirpv/volume/quota/quotatest"
)

const labelPattern = "${pvc.metadata.namespace}/${pvc.metadata.labels['team']}/${pvc.metadata.name}-${pv.metadata.name}"

var benchSink any

func benchVars() pathVars {
	return pathVars{
		namespace: "team-storage-prod", pvcName: "postgres-data-0",
		pvName:      "pvc-6f1c2a8e-3b7d-4e0f-9a51-2c8d7e4b1f90",
		labels:      map[string]string{"team": "payments", "app": "postgres"},
		annotations: map[string]string{"owner": "alice"},
	}
}

// loop runs fn as benchmark b's loop, failing on an error and keeping the result alive.
func loop[T any](b *testing.B, fn func() (T, error)) {
	b.ReportAllocs()
	for b.Loop() {
		v, err := fn()
		if err != nil {
			b.Fatal(err)
		}
		benchSink = v
	}
}

func BenchmarkParsePattern(b *testing.B) {
	for _, pat := range []string{DefaultPathPattern, labelPattern} {
		b.Run(patternName(pat), func(b *testing.B) { loop(b, func() (*pattern, error) { return parsePattern(pat) }) })
	}
}

func BenchmarkExpand(b *testing.B) {
	vars := benchVars()
	for _, pat := range []string{DefaultPathPattern, labelPattern} {
		p, err := parsePattern(pat)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(patternName(pat), func(b *testing.B) { loop(b, func() (string, error) { return p.expand(vars) }) })
	}
}

func patternName(p string) string {
	if p == DefaultPathPattern {
		return "default"
	}
	return "labels"
}

func BenchmarkParseParameters(b *testing.B) {
	for name, params := range map[string]map[string]string{
		"local": {"backend": "local", "basePath": "/var/lib/dirpv"},
		"nfs": {"backend": "nfs", "server": "nfs.example.com", "share": "/srv/export", "pathPattern": labelPattern,
			"onDelete": "archive", "mode": "2775", "uid": "1000", "gid": "1000"},
	} {
		b.Run(name, func(b *testing.B) { loop(b, func() (*classParams, error) { return parseParameters(params) }) })
	}
}

func BenchmarkCleanRelPath(b *testing.B) {
	for name, p := range map[string]string{
		"one":   "team-storage-prod-postgres-data-0-pvc-6f1c2a8e-3b7d-4e0f-9a51-2c8d7e4b1f90",
		"three": "team-storage-prod/payments/postgres-data-0-pvc-6f1c2a8e-3b7d-4e0f-9a51-2c8d7e4b1f90",
	} {
		b.Run(name, func(b *testing.B) { loop(b, func() (string, error) { return volume.CleanRelPath(p) }) })
	}
}

func benchAttrs() map[string]volume.Attributes {
	return map[string]volume.Attributes{
		"local": {Backend: volume.BackendLocal, BasePath: "/var/lib/dirpv", Path: "ns-claim-pvc-6f1c2a8e-3b7d-4e0f-9a51-2c8d7e4b1f90"},
		"nfs":   {Backend: volume.BackendNFS, Server: "nfs.example.com", Share: "/srv/export", Path: "ns/claim-pvc-6f1c2a8e"},
	}
}

// BenchmarkParseAttributes is what the node plugin does with every NodePublishVolume's context.
func BenchmarkParseAttributes(b *testing.B) {
	for name, a := range benchAttrs() {
		m := a.Map()
		b.Run(name, func(b *testing.B) { loop(b, func() (volume.Attributes, error) { return volume.ParseAttributes(m) }) })
	}
}

func BenchmarkAttributesMap(b *testing.B) {
	for name, a := range benchAttrs() {
		b.Run(name, func(b *testing.B) { loop(b, func() (map[string]string, error) { return a.Map(), nil }) })
	}
}

func benchOptions(class *storagev1.StorageClass) controller.ProvisionOptions {
	return controller.ProvisionOptions{
		StorageClass: class,
		PVName:       "pvc-6f1c2a8e-3b7d-4e0f-9a51-2c8d7e4b1f90",
		PVC: &v1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "postgres-data-0", Namespace: "team-storage-prod", UID: "0c9a6d3e-5b1f-4f7a-8e2d-6a4b9c1d7e35",
				Labels: map[string]string{"team": "payments"}, Annotations: map[string]string{annSelectedNode: "node-a"}},
			Spec: v1.PersistentVolumeClaimSpec{
				AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
				Resources:   v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("10Gi")}},
			},
		},
		SelectedNodeName: "node-a",
	}
}

func benchClasses(base string) map[string]*storagev1.StorageClass {
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	return map[string]*storagev1.StorageClass{
		"local": {ObjectMeta: metav1.ObjectMeta{Name: "local"}, Provisioner: "dirpv.io", VolumeBindingMode: &wffc,
			Parameters: map[string]string{"backend": "local", "basePath": base}},
		"nfs": {ObjectMeta: metav1.ObjectMeta{Name: "nfs"}, Provisioner: "dirpv.io", MountOptions: []string{"nfsvers=4.1", "hard"},
			Parameters: map[string]string{"backend": "nfs", "server": "nfs.example.com", "share": "/srv/export"}},
	}
}

func BenchmarkBuildPV(b *testing.B) {
	for name, class := range benchClasses("/var/lib/dirpv") {
		role := RoleController
		if name == "local" {
			role = RoleNode
		}
		p := &Provisioner{cfg: Config{DriverName: "dirpv.io", Role: role, NodeName: "node-a"}}
		opts := benchOptions(class)
		params, err := p.checkClaim(opts)
		if err != nil {
			b.Fatal(err)
		}
		attrs := volume.Attributes{Backend: params.backend, Server: params.server, Share: params.share, BasePath: params.basePath,
			Path: "team-storage-prod-postgres-data-0-" + opts.PVName}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				benchSink = p.buildPV(opts, params, attrs, "host-a")
			}
		})
	}
}

// BenchmarkShouldProvision is the Qualifier the lib calls for every claim event it sees, on
// every node: it must stay cheap however many claims the cluster has.
func BenchmarkShouldProvision(b *testing.B) {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	classes := benchClasses("/var/lib/dirpv")
	for _, c := range classes {
		idx.Add(c)
	}
	bases, _ := volume.NewAllowedBases([]string{"/var/lib/dirpv"}, "/var/lib/kubelet")
	p, err := New(Config{DriverName: "dirpv.io", Role: RoleNode, NodeName: "node-a", Client: fake.NewClientset(),
		Classes: storagelisters.NewStorageClassLister(idx), AllowedBases: bases, StateDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	claim := benchOptions(classes["local"]).PVC
	name := "local"
	claim.Spec.StorageClassName = &name
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if !p.ShouldProvision(ctx, claim) {
			b.Fatal("should provision")
		}
	}
}

// BenchmarkProvisionDeleteLocal is one whole local Provision (checks, template, mkdir beneath
// the base without following symlinks, PV) and Delete (remove the tree), on a real temp dir.
// The btrfs cases split what a size limit costs on disk: the same file system without quota
// (a directory per volume) and with it (a subvolume and a qgroup limit per volume).
func BenchmarkProvisionDeleteLocal(b *testing.B) {
	for _, c := range []struct {
		name string
		base func(b *testing.B) string
	}{
		{"dir", func(b *testing.B) string { return b.TempDir() }},
		// Large: btrfs frees a deleted subvolume's space in the background, behind the loop.
		{"btrfs", func(b *testing.B) string { return quotatest.BtrfsOfSize(b, 8<<30, false) }},
		{"btrfs-qgroup", func(b *testing.B) string { return quotatest.BtrfsOfSize(b, 8<<30, true) }},
	} {
		b.Run(c.name, func(b *testing.B) { benchProvisionDelete(b, c.base(b)) })
	}
}

func benchProvisionDelete(b *testing.B, base string) {
	client := fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", Labels: map[string]string{v1.LabelHostname: "host-a"}}})
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	class := benchClasses(base)["local"]
	idx.Add(class)
	bases, _ := volume.NewAllowedBases([]string{base}, "/var/lib/kubelet")
	p, err := New(Config{DriverName: "dirpv.io", Role: RoleNode, NodeName: "node-a", Client: client,
		Classes: storagelisters.NewStorageClassLister(idx), AllowedBases: bases, StateDir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	// Logging is not what this measures.
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), klog.Background().V(100)))
	defer cancel()
	go p.Run(ctx)
	opts := benchOptions(class)
	// A claim larger than a base's free space is refused (rescheduled) before anything is made.
	opts.PVC = opts.PVC.DeepCopy()
	opts.PVC.Spec.Resources.Requests[v1.ResourceStorage] = resource.MustParse("16Mi")
	b.ReportAllocs()
	i := 0
	var provision time.Duration
	for b.Loop() {
		opts.PVName = fmt.Sprintf("pvc-%d", i)
		i++
		t0 := time.Now()
		pv, _, err := p.Provision(ctx, opts)
		provision += time.Since(t0)
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Delete(ctx, pv); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(provision.Microseconds())/float64(i), "provision-µs/op")
}
