package provisioner

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/mount-utils"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/dirpv/dirpv/internal/metricstest"
	"github.com/dirpv/dirpv/volume"
)

const (
	testDriver = "dirpv.io"
	testNode   = "node-a"
)

type fixture struct {
	t       *testing.T
	base    string
	classes cache.Indexer
	node    *Provisioner
	ctrl    *Provisioner
	mounter *mount.FakeMounter
	// events holds what the node instance recorded beyond the lib's events.
	events *record.FakeRecorder
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	return newFixtureOn(t, t.TempDir())
}

// newFixtureOn is newFixture with local volumes under base.
func newFixtureOn(t *testing.T, base string) *fixture {
	t.Helper()
	f := &fixture{t: t, base: base, mounter: mount.NewFakeMounter(nil), events: record.NewFakeRecorder(100)}
	f.classes = cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
	client := fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: testNode, Labels: map[string]string{v1.LabelHostname: "host-a"},
	}})
	lister := storagelisters.NewStorageClassLister(f.classes)
	bases, err := volume.NewAllowedBases([]string{f.base}, "/var/lib/kubelet")
	must(t, err)
	f.node, err = New(Config{DriverName: testDriver, Role: RoleNode, NodeName: testNode, Client: client, Classes: lister, AllowedBases: bases, StateDir: t.TempDir(), Events: f.events})
	must(t, err)
	f.ctrl, err = New(Config{DriverName: testDriver, Role: RoleController, Client: client, Classes: lister,
		Mounter: f.mounter, WorkDir: t.TempDir(), OperationTimeout: 5 * time.Second})
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	go f.node.Run(ctx)
	go f.ctrl.Run(ctx)
	t.Cleanup(cancel)
	return f
}

func (f *fixture) localClass(params map[string]string) *storagev1.StorageClass {
	p := map[string]string{"backend": "local", "basePath": f.base}
	for k, v := range params {
		p[k] = v
	}
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	c := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "local"}, Provisioner: testDriver, Parameters: p, VolumeBindingMode: &wffc}
	f.classes.Add(c)
	return c
}

func claim(name string, modes ...v1.PersistentVolumeAccessMode) *v1.PersistentVolumeClaim {
	if len(modes) == 0 {
		modes = []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce}
	}
	return &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name),
			Annotations: map[string]string{annSelectedNode: testNode}},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes: modes,
			Resources:   v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
}

func opts(class *storagev1.StorageClass, pvc *v1.PersistentVolumeClaim) controller.ProvisionOptions {
	pvc.Spec.StorageClassName = &class.Name
	return controller.ProvisionOptions{StorageClass: class, PVName: "pvc-" + string(pvc.UID), PVC: pvc, SelectedNodeName: pvc.Annotations[annSelectedNode]}
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// listTree returns every path under dir, to show that a refused claim changed nothing.
func listTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err == nil && p != dir {
			out = append(out, strings.TrimPrefix(p, dir+"/"))
		}
		return nil
	})
	return out
}

// The node instance's part in a local claim's life that the integration tier does not see: which
// instance takes the claim and the PV, retried Provision and Delete, and the metrics of each call,
// a refused one and an NFS PV's Delete passed over included. The annotations its Delete reads
// instead of the class are in the stored PVs of formats_test.go and mountpoint_test.go (the default
// onDelete). The directory's mode and owner and the PV's attributes, node affinity and label,
// test/integration's TestLocalClaimBindsOnScheduledNode and TestNodeInstancesCacheOwnVolumesOnly
// check through a real apiserver.
func TestProvisionLocal(t *testing.T) {
	f := newFixture(t)
	// As the lib calls it: every Provision and Delete is counted under its backend and result.
	reg := prometheus.NewPedanticRegistry()
	node := Instrument(f.node, reg)
	class := f.localClass(map[string]string{"pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.labels['app']}-${pv.metadata.name}"})
	pvc := claim("data")
	pvc.Labels = map[string]string{"app": "web"}
	o := opts(class, pvc)
	if !f.node.ShouldProvision(context.Background(), o.PVC) {
		t.Fatal("node instance does not accept a claim placed on its node")
	}
	if f.ctrl.ShouldProvision(context.Background(), o.PVC) {
		t.Fatal("controller accepts a claim of a valid local class")
	}
	pv, state, err := node.Provision(context.Background(), o)
	if err != nil || state != controller.ProvisioningFinished {
		t.Fatalf("Provision = %v, %v", state, err)
	}
	dir := filepath.Join(f.base, "ns", "web-pvc-uid-data")
	if _, err := os.Stat(dir); err != nil || pv.Spec.CSI.VolumeAttributes["path"] != "ns/web-pvc-uid-data" {
		t.Fatalf("volume directory: %v; PV path %q", err, pv.Spec.CSI.VolumeAttributes["path"])
	}

	// A retried Provision (e.g. after a crash before the PV was saved) finds its own directory.
	if _, _, err := node.Provision(context.Background(), o); err != nil {
		t.Errorf("repeated Provision: %v", err)
	}
	block := claim("block")
	block.Spec.VolumeMode = ptr.To(v1.PersistentVolumeBlock)
	if _, _, err := node.Provision(context.Background(), opts(class, block)); err == nil {
		t.Fatal("a Block claim was provisioned")
	}

	// Released, its node still there: the controller leaves it to that node, which deletes the
	// directory (a lost node's PV, the controller's: integration TestLostNodeDoesNotJamDeletion).
	pv.Status.Phase = v1.VolumeReleased
	if !f.node.ShouldDelete(context.Background(), pv) || f.ctrl.ShouldDelete(context.Background(), pv) {
		t.Error("ShouldDelete: want node yes, controller no")
	}
	must(t, node.Delete(context.Background(), pv))
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("directory still there after delete: %v", err)
	}
	if err := node.Delete(context.Background(), pv); err != nil {
		t.Errorf("repeated Delete: %v", err)
	}
	nfsPV := &v1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-nfs"}, Spec: v1.PersistentVolumeSpec{
		PersistentVolumeSource: v1.PersistentVolumeSource{CSI: &v1.CSIPersistentVolumeSource{
			Driver: testDriver, VolumeAttributes: map[string]string{"backend": "nfs"}}}}}
	if err := node.Delete(context.Background(), nfsPV); err == nil {
		t.Fatal("a node instance deleted an NFS volume")
	}

	for _, c := range []struct {
		name, backend, result string
		want                  uint64
	}{
		{"dirpv_provision_duration_seconds", "local", "success", 2},
		{"dirpv_provision_duration_seconds", "local", "infeasible", 1},
		{"dirpv_delete_duration_seconds", "local", "success", 2},
		{"dirpv_delete_duration_seconds", "nfs", "ignored", 1},
	} {
		if n := metricstest.HistogramCount(t, reg, c.name, map[string]string{"backend": c.backend, "result": c.result}); n != c.want {
			t.Errorf("%s{backend=%s,result=%s} counted %d calls, want %d", c.name, c.backend, c.result, n, c.want)
		}
	}
	// A node has no NFS exports to report.
	if n := testutil.CollectAndCount(&exportsCollector{p: f.node}); n != 0 {
		t.Errorf("node instance reports %d export metrics, want none", n)
	}
}

// nfsClassWith makes the class an NFS one with the parameter k=v.
func nfsClassWith(k, v string) func(*storagev1.StorageClass, *v1.PersistentVolumeClaim) {
	return func(s *storagev1.StorageClass, _ *v1.PersistentVolumeClaim) {
		s.Parameters = map[string]string{"backend": "nfs", "server": "s", "share": "/s", k: v}
	}
}

// A claim dirpv refuses for good gets InvalidArgument (the lib's slow retries), a message
// fit for the claim's event, and nothing on disk. A bad value a user put in a claim or a class
// (the rows with a 1 MiB value) reaches the message only as a short prefix, with its size.
func TestRejectionsLeaveNothingOnDisk(t *testing.T) {
	block := v1.PersistentVolumeBlock
	huge := strings.Repeat("x", 1<<20)
	hugeDir := func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) { c.Annotations["dir"] = huge + "/" }
	for name, tc := range map[string]struct {
		params map[string]string
		mutate func(*storagev1.StorageClass, *v1.PersistentVolumeClaim)
		want   string
	}{
		"unknown parameter":   {params: map[string]string{"bsaePath": "/x"}, want: "unknown StorageClass parameters"},
		"bad template":        {params: map[string]string{"pathPattern": "${pvc.metadata.uid}"}, want: "unknown variable"},
		"unterminated":        {params: map[string]string{"pathPattern": "${pvc.metadata.name"}, want: "unterminated"},
		"dotdot template":     {params: map[string]string{"pathPattern": "../${pvc.metadata.name}"}, want: "component"},
		"absolute template":   {params: map[string]string{"pathPattern": "/etc/${pvc.metadata.name}"}, want: "absolute"},
		"escaping annotation": {params: map[string]string{"pathPattern": "${pvc.metadata.annotations['dir']}"}, mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) { c.Annotations["dir"] = "../../etc" }, want: "may not appear"},
		"dotdot annotation":   {params: map[string]string{"pathPattern": "${pvc.metadata.annotations['dir']}"}, mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) { c.Annotations["dir"] = ".." }, want: "not a directory name"},
		"reserved name": {params: map[string]string{"pathPattern": "${pvc.metadata.annotations['dir']}"}, mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Annotations["dir"] = volume.ReservedPrefix + "vol-2"
		}, want: "reserves"},
		"missing label":              {params: map[string]string{"pathPattern": "${pvc.metadata.labels['team']}"}, want: "does not have"},
		"unknown onDelete":           {params: map[string]string{"onDelete": "shred"}, want: "onDelete"},
		"bad mode":                   {params: map[string]string{"mode": "rwx"}, want: "octal"},
		"bad uid":                    {params: map[string]string{"uid": "-1"}, want: "uid"},
		"nfs param on local":         {params: map[string]string{"server": "x"}, want: "for backend nfs"},
		"bad capacityEnforcement":    {params: map[string]string{ParamCapacityEnforcement: "always"}, want: ParamCapacityEnforcement},
		"capacityEnforcement on nfs": {mutate: nfsClassWith(ParamCapacityEnforcement, "required"), want: ParamCapacityEnforcement},
		"bad basePathMountPoint":     {params: map[string]string{ParamBasePathMountPoint: "yes"}, want: ParamBasePathMountPoint},
		"basePathMountPoint case":    {params: map[string]string{ParamBasePathMountPoint: "Required"}, want: `"Required"`},
		"basePathMountPoint on nfs":  {mutate: nfsClassWith(ParamBasePathMountPoint, "required"), want: ParamBasePathMountPoint},
		"relative basePath":          {params: map[string]string{"basePath": "var/lib"}, want: "absolute"},
		"block mode":                 {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) { c.Spec.VolumeMode = &block }, want: "Block"},
		"rwx on local": {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Spec.AccessModes = []v1.PersistentVolumeAccessMode{v1.ReadWriteMany}
		}, want: "ReadWriteMany"},
		"mountOptions local": {mutate: func(s *storagev1.StorageClass, _ *v1.PersistentVolumeClaim) { s.MountOptions = []string{"noatime"} }, want: "mountOptions"},
		"data source of another kind": {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Spec.DataSource = &v1.TypedLocalObjectReference{APIGroup: ptr.To("example.com"), Kind: "Backup", Name: "x"}
		}, want: "dataSource kind Backup of apiGroup example.com is not supported"},
		"data source in another namespace": {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{Kind: "PersistentVolumeClaim", Name: "x", Namespace: ptr.To("other")}
		}, want: "cross-namespace data sources are not supported"},
		"data source ref naming its own namespace": {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Spec.DataSourceRef = &v1.TypedObjectReference{Kind: "PersistentVolumeClaim", Name: "x", Namespace: ptr.To("ns")}
		}, want: "leave out dataSourceRef.namespace"},
		"missing source claim": {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Spec.DataSource = &v1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "x"}
		}, want: "PersistentVolumeClaim ns/x does not exist"},
		"immediate local": {mutate: func(s *storagev1.StorageClass, _ *v1.PersistentVolumeClaim) { s.VolumeBindingMode = nil }, want: "WaitForFirstConsumer"},
		"other node's claim": {mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Annotations[annSelectedNode] = "node-b"
		}, want: "node-b"},
		"long annotation": {params: map[string]string{"pathPattern": "${pvc.metadata.annotations['dir']}"}, mutate: func(_ *storagev1.StorageClass, c *v1.PersistentVolumeClaim) {
			c.Annotations["dir"] = strings.Repeat("x", 300)
		}, want: "bytes"},
		"huge annotation value":         {params: map[string]string{"pathPattern": "${pvc.metadata.annotations['dir']}"}, mutate: hugeDir, want: "(1048"},
		"huge parameter name":           {params: map[string]string{huge: "1"}, want: "(1048"},
		"huge mode":                     {params: map[string]string{"mode": huge}, want: "(1048"},
		"huge onDelete":                 {params: map[string]string{"onDelete": huge}, want: "(1048"},
		"huge pattern":                  {params: map[string]string{"pathPattern": "/" + huge}, want: "(1048"},
		"huge pattern variable":         {params: map[string]string{"pathPattern": "${" + huge + "}"}, want: "(1048"},
		"huge basePath":                 {params: map[string]string{"basePath": "/" + huge + "/"}, want: "(1048"},
		"huge missing annotation's key": {params: map[string]string{"pathPattern": "${pvc.metadata.annotations['" + huge + "']}"}, want: "(1048"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			class := f.localClass(tc.params)
			pvc := claim("c")
			o := opts(class, pvc)
			if tc.mutate != nil {
				tc.mutate(class, pvc)
				o.SelectedNodeName = pvc.Annotations[annSelectedNode]
			}
			_, state, err := f.node.Provision(context.Background(), o)
			if err == nil || !strings.Contains(err.Error(), tc.want) || len(err.Error()) > 1024 {
				t.Fatalf("Provision error = %.1100v, want at most 1 KiB mentioning %q", err, tc.want)
			}
			if state != controller.ProvisioningFinished {
				t.Errorf("state = %s, want Finished", state)
			}
			// The lib treats only InvalidArgument as infeasible: one event, then slow retries.
			if code := status.Code(err); code != codes.InvalidArgument {
				t.Errorf("gRPC code = %s, want InvalidArgument so the lib does not retry hot", code)
			}
			if strings.HasPrefix(err.Error(), "rpc error") {
				t.Errorf("message %q carries gRPC's prefix into the user's event", err)
			}
			if entries := listTree(t, f.base); len(entries) != 0 {
				t.Errorf("refused claim left %v on disk", entries)
			}
		})
	}
}

// A directory at a new claim's path is not handed to it: not another claim's volume (left by
// onDelete retain, say), which the refusal leaves as it was, mode, owner and times included,
// nor one dirpv did not make. That the first claim's data stays and the new claim gets no PV,
// test/integration's TestHostileCollidingClaims/left-from-earlier-pv shows.
func TestExistingDirectoryNotHandedToAnotherClaim(t *testing.T) {
	f := newFixture(t)
	class := f.localClass(map[string]string{"pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.name}"})
	_, _, err := f.node.Provision(context.Background(), opts(class, claim("db")))
	must(t, err)
	before := listTree(t, f.base)
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(f.base, "ns/db"), &st))
	again := claim("db")
	again.UID = "uid-db-2"
	_, state, err := f.node.Provision(context.Background(), opts(class, again))
	if err == nil || !strings.Contains(err.Error(), "directory ns/db already exists") || !strings.Contains(err.Error(), "belongs to another claim") {
		t.Errorf("second claim got the first one's directory (err %v)", err)
	}
	if state != controller.ProvisioningFinished {
		t.Errorf("state %s, want Finished", state)
	}
	if after := listTree(t, f.base); !slices.Equal(before, after) {
		t.Errorf("the refusal changed the base: %v, was %v", after, before)
	}
	var after unix.Stat_t
	if err := unix.Stat(filepath.Join(f.base, "ns/db"), &after); err != nil || after.Mode != st.Mode || after.Uid != st.Uid || after.Mtim != st.Mtim {
		t.Errorf("the refused directory changed: %+v, was %+v (%v)", after, st, err)
	}

	must(t, os.Mkdir(filepath.Join(f.base, "ns/manual"), 0o777))
	_, _, err = f.node.Provision(context.Background(), opts(class, claim("manual")))
	if err == nil || !strings.Contains(err.Error(), "is not a volume dirpv made") {
		t.Errorf("a directory dirpv did not make was handed over (err %v)", err)
	}
}

// A PV's Delete can come again after its directory is gone (a crash after the removal, before
// the PV was deleted), and with a pattern without ${pv.metadata.name} the name may by then be
// another claim's volume. That volume is left alone by a stale PV whose onDelete is archive,
// bound or not. With onDelete delete (the default), test/integration's
// TestDeleteOfAnotherClaimsDirectoryIsRefused shows it through a real apiserver, on both backends.
func TestStaleDeleteLeavesAnotherClaimsDirectory(t *testing.T) {
	for _, backend := range []volume.Backend{volume.BackendLocal, volume.BackendNFS} {
		t.Run(string(backend), func(t *testing.T) {
			s := newStoreFixture(t, backend, map[string]string{"pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.name}", "onDelete": "archive"})
			first := s.claim("db")
			stale, _, err := s.p.Provision(context.Background(), opts(s.class, first))
			must(t, err)
			// As the lib binds it.
			stale.Spec.ClaimRef = &v1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: first.Namespace, Name: first.Name, UID: first.UID}
			must(t, s.p.Delete(context.Background(), stale))
			second := s.claim("db")
			second.UID = "uid-db-2"
			if _, _, err := s.p.Provision(context.Background(), opts(s.class, second)); err != nil {
				t.Fatalf("the name is free again, but the new claim was refused: %v", err)
			}
			data := filepath.Join(s.base, "ns/db/data")
			must(t, os.WriteFile(data, []byte("second's"), 0o600))
			s.settle(t)
			before := listTree(t, s.base)
			err = s.p.Delete(context.Background(), stale)
			if err == nil || !strings.Contains(err.Error(), "belongs to another claim") {
				t.Fatalf("stale PV's Delete = %v, want a refusal", err)
			}
			// Without a claimRef (never bound), the PV name decides.
			stale.Spec.ClaimRef = nil
			if err := s.p.Delete(context.Background(), stale); err == nil {
				t.Fatal("stale unbound PV's Delete succeeded")
			}
			s.settle(t)
			if after := listTree(t, s.base); !slices.Equal(before, after) {
				t.Errorf("refused Delete changed the base: %v, was %v", after, before)
			}
			if b, err := os.ReadFile(data); err != nil || string(b) != "second's" {
				t.Errorf("second claim's data: %q %v", b, err)
			}
		})
	}
}

// A pattern whose path runs through another volume, or through a symlink or a file where a
// directory should be, is refused for good: no retry changes that until the class or what is
// in the way changes, so the lib must get InvalidArgument (its slow retries), and the base and
// what a planted link points to are left as they were.
func TestPathThroughVolumeOrLinkIsInfeasible(t *testing.T) {
	for _, backend := range []volume.Backend{volume.BackendLocal, volume.BackendNFS} {
		for name, tc := range map[string]struct {
			plant func(t *testing.T, s *storeFixture, outside string)
			want  string
		}{
			"inside another volume": {plant: func(t *testing.T, s *storeFixture, _ string) {
				outer := s.class.DeepCopy()
				outer.Parameters["pathPattern"] = "${pvc.metadata.namespace}"
				_, _, err := s.p.Provision(context.Background(), opts(outer, s.claim("outer")))
				must(t, err)
			}, want: "never created inside another"},
			"through a symlink": {plant: func(t *testing.T, s *storeFixture, outside string) {
				must(t, os.Symlink(outside, filepath.Join(s.base, "ns")))
			}, want: "symlinks are never followed"},
			"through a file": {plant: func(t *testing.T, s *storeFixture, _ string) {
				must(t, os.WriteFile(filepath.Join(s.base, "ns"), nil, 0o600))
			}, want: "not a directory"},
		} {
			t.Run(string(backend)+"/"+name, func(t *testing.T) {
				s := newStoreFixture(t, backend, map[string]string{"pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.name}"})
				outside := t.TempDir()
				tc.plant(t, s, outside)
				before := listTree(t, s.base)
				_, state, err := s.p.Provision(context.Background(), opts(s.class, s.claim("c")))
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Provision error = %v, want one mentioning %q", err, tc.want)
				}
				if state != controller.ProvisioningFinished {
					t.Errorf("state = %s, want Finished", state)
				}
				if code := status.Code(err); code != codes.InvalidArgument {
					t.Errorf("gRPC code = %s, want InvalidArgument so the lib does not retry hot", code)
				}
				if after := listTree(t, s.base); !slices.Equal(before, after) {
					t.Errorf("refused claim changed the base: %v, was %v", after, before)
				}
				if entries := listTree(t, outside); len(entries) != 0 {
					t.Errorf("refused claim made %v behind the symlink", entries)
				}
			})
		}
	}
}

// storeFixture is one Provisioner serving a class of the given backend, whose volumes are made
// in base: a node instance on a local base path, or a controller on a stand-in NFS export.
type storeFixture struct {
	p       *Provisioner
	class   *storagev1.StorageClass
	base    string
	backend volume.Backend
}

func newStoreFixture(t *testing.T, backend volume.Backend, params map[string]string) *storeFixture {
	t.Helper()
	if backend == volume.BackendLocal {
		f := newFixture(t)
		return &storeFixture{p: f.node, class: f.localClass(params), base: f.base, backend: backend}
	}
	f := newTrashFixture(t, 5*time.Second)
	for k, v := range params {
		f.class.Parameters[k] = v
	}
	return &storeFixture{p: f.start(t), class: f.class, base: f.src, backend: backend}
}

// claim returns a claim as the lib hands it to the backend's instance.
func (s *storeFixture) claim(name string) *v1.PersistentVolumeClaim {
	c := claim(name)
	if s.backend == volume.BackendNFS {
		delete(c.Annotations, annSelectedNode)
	}
	return c
}

// settle waits until no NFS volume is left to remove in the background, so the base holds
// still between two looks.
func (s *storeFixture) settle(t *testing.T) {
	t.Helper()
	eventually(t, time.Minute, func() (bool, string) {
		n := s.p.PendingDeletes()
		return n == 0, fmt.Sprintf("%d deletes pending", n)
	})
}

// An NFS claim is the controller's: its PV has no node affinity and exactly the attributes a node
// plugin mounts it by, the class may be gone by the time it is deleted, and no node instance takes
// its Delete; the export's metrics never carry its mount options; an idle export is unmounted in
// the background. That the claims of the export's classes share one mount with the classes'
// options, that the PV carries the class's mountOptions to each pod's mount of server:share/path,
// and that onDelete archive renames the directory to archived-<dir>-<time>, test/vm/node's
// TestNFSReclaimOnGuestNode and TestNFSClaimRWXOnGuestNode show on a kernel NFS server with real
// pods.
func TestProvisionNFSEmitsSelfDescribingPV(t *testing.T) {
	f := newFixture(t)
	reg := prometheus.NewPedanticRegistry()
	ctrl := Instrument(f.ctrl, reg)
	class := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "nfs"}, Provisioner: testDriver,
		Parameters:   map[string]string{"backend": "nfs", "server": "127.0.0.1", "share": "/export", "onDelete": "archive"},
		MountOptions: []string{"vers=4.1", "sec=sys,secret-token=hunter2"}}
	f.classes.Add(class)
	pvc := claim("a", v1.ReadWriteMany)
	delete(pvc.Annotations, annSelectedNode)
	if f.node.ShouldProvision(context.Background(), pvc) || !f.ctrl.ShouldProvision(context.Background(), opts(class, pvc).PVC) {
		t.Fatal("want the controller, not a node, to take NFS claims")
	}
	pv, _, err := ctrl.Provision(context.Background(), opts(class, claim("a", v1.ReadWriteMany)))
	must(t, err)
	checkExportMetrics(t, reg)
	if pv.Spec.NodeAffinity != nil {
		t.Error("NFS PV has node affinity")
	}
	want := map[string]string{"backend": "nfs", "server": "127.0.0.1", "share": "/export", "path": "ns-a-pvc-uid-a"}
	if !maps.Equal(pv.Spec.CSI.VolumeAttributes, want) {
		t.Errorf("attributes %v, want %v", pv.Spec.CSI.VolumeAttributes, want)
	}
	// The fake mounter mounts nothing, so the directories are in the mount point dir itself.
	dir := filepath.Join(f.mounter.MountPoints[0].Path, "ns-a-pvc-uid-a")
	_, err = os.Stat(dir)
	must(t, err)
	// The class may be gone by delete time: the PV says what to do.
	f.classes.Delete(class)
	must(t, ctrl.Delete(context.Background(), pv))
	if _, ok := f.node.Delete(context.Background(), pv).(*controller.IgnoredError); !ok {
		t.Error("node instance did not ignore an NFS PV")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume directory after Delete: %v", err)
	}

	// Idle exports are unmounted, in the background.
	f.ctrl.exports.Sweep(context.Background(), -1)
	eventually(t, 5*time.Second, func() (bool, string) {
		mps, _ := f.mounter.List()
		return len(mps) == 0, fmt.Sprintf("still mounted after idle sweep: %+v", mps)
	})
}

// checkExportMetrics checks what the controller reports after one NFS provision: the provision,
// one mounted export, nothing stuck, labelled server:share only: mount options, which may
// carry credentials, never reach a label.
func checkExportMetrics(t *testing.T, reg *prometheus.Registry) {
	t.Helper()
	if n := metricstest.HistogramCount(t, reg, "dirpv_provision_duration_seconds", map[string]string{"backend": "nfs", "result": "success"}); n != 1 {
		t.Errorf("successful NFS provisions: %d, want 1", n)
	}
	want := `
# HELP dirpv_nfs_export_saturated 1 while every call slot of an NFS export is taken, so that new calls on it fail at once; 0 otherwise. By export (server:share).
# TYPE dirpv_nfs_export_saturated gauge
dirpv_nfs_export_saturated{export="127.0.0.1:/export"} 0
# HELP dirpv_nfs_export_stuck_calls Calls on an NFS export whose callers gave up waiting for the server but that still run, by export (server:share).
# TYPE dirpv_nfs_export_stuck_calls gauge
dirpv_nfs_export_stuck_calls{export="127.0.0.1:/export"} 0
# HELP dirpv_nfs_exports_mounted NFS exports the controller has mounted under its work dir now.
# TYPE dirpv_nfs_exports_mounted gauge
dirpv_nfs_exports_mounted 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"dirpv_nfs_export_saturated", "dirpv_nfs_export_stuck_calls", "dirpv_nfs_exports_mounted"); err != nil {
		t.Error(err)
	}
	mfs, err := reg.Gather()
	must(t, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if strings.Contains(l.GetValue(), "hunter2") {
					t.Errorf("%s carries a mount option in label %s=%q", mf.GetName(), l.GetName(), l.GetValue())
				}
			}
		}
	}
}

func TestArchiveNameFits(t *testing.T) {
	now := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	if got := archiveName("ns/vol", now); got != "archived-vol-20261129T120000Z" {
		t.Errorf("archiveName = %q", got)
	}
	if got := archiveName(strings.Repeat("x", 255), now); len(got) > volume.MaxComponentLength {
		t.Errorf("archive name of a long directory is %d bytes", len(got))
	}
}

// A node whose base path cannot take the volume hands the claim back to the scheduler, and
// says which node and what failed. A read-only base: test/integration's
// TestReadOnlyBaseReschedules, through the real scheduler.
func TestNodeLocalFailureReschedules(t *testing.T) {
	for name, tc := range map[string]struct {
		base       func(t *testing.T) string // the allowed base
		sub        string                    // the class's base path in it
		size, want string
	}{
		"base not creatable": {func(t *testing.T) string {
			base := t.TempDir()
			must(t, os.WriteFile(filepath.Join(base, "file"), nil, 0o600))
			return base
		}, "file/base", "1Gi", "not a directory"},
		// A tmpfs with no free inode: mkdir fails with ENOSPC, as on a full disk. The claim is
		// small enough to pass the free-space check, so that mkdir itself fails.
		"full base": {func(t *testing.T) string { return tmpfs(t, "size=1m,nr_inodes=1") }, "", "1Ki", "no space left on device"},
		// A limit reserves nothing: the scheduler's figure was stale, the claim cannot fit.
		"claim larger than the free space": {func(t *testing.T) string { return tmpfs(t, "size=8m") }, "", "1Gi",
			"the claim asks for 1Gi but only 8Mi is free"},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixtureOn(t, tc.base(t))
			classBase := filepath.Join(f.base, tc.sub)
			class := f.localClass(map[string]string{"basePath": classBase})
			_, state, err := f.node.Provision(context.Background(), opts(class, sizedClaim("c", tc.size)))
			if state != controller.ProvisioningReschedule {
				t.Errorf("state = %s (err %v), want Reschedule", state, err)
			}
			if err == nil || !strings.Contains(err.Error(), "node "+testNode) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error = %v, want one naming node %s and saying %q", err, testNode, tc.want)
			}
			if status.Code(err) == codes.InvalidArgument {
				t.Error("a node-local failure is marked infeasible; the lib would not reschedule it")
			}
			if got := listTree(t, classBase); len(got) != 0 {
				t.Errorf("base holds %v after the refusal, want nothing", got)
			}
		})
	}
}

// The controller tells the user, once per claim per period, when a local claim waits on a node
// where no dirpv node plugin is registered, and says nothing about nodes that have one; and when
// a WaitForFirstConsumer claim cannot be served anywhere, which published capacity keeps
// unplaced, for local and NFS classes alike, while a class that is fine gets no such event.
func TestControllerReportsClaimsItCannotServe(t *testing.T) {
	f := newFixture(t)
	client := f.ctrl.cfg.Client
	for node, driver := range map[string]string{testNode: testDriver, "node-b": "other.csi.io"} {
		_, err := client.StorageV1().CSINodes().Create(context.Background(), &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: node},
			Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver, NodeID: node}}}}, metav1.CreateOptions{})
		must(t, err)
	}
	events := record.NewFakeRecorder(10)
	f.ctrl.cfg.Events = events
	class := f.localClass(nil)

	for _, node := range []string{"node-b", "node-c"} { // a CSINode without dirpv, and none at all
		pvc := claim("on-" + node)
		pvc.Annotations[annSelectedNode] = node
		pvc.Spec.StorageClassName = &class.Name
		for range 3 {
			if f.ctrl.ShouldProvision(context.Background(), pvc) {
				t.Fatal("controller takes a claim of a valid local class")
			}
		}
		select {
		case ev := <-events.Events:
			if !strings.Contains(ev, ReasonNodePluginMissing) || !strings.Contains(ev, "node "+node+" runs no dirpv.io node plugin") {
				t.Errorf("event = %q", ev)
			}
		default:
			t.Errorf("no event for a claim on %s", node)
		}
	}
	// Claims on a node that runs the plugin get no event, and a burst of them costs one lookup.
	lookups := 0
	client.(*fake.Clientset).PrependReactor("get", "csinodes", func(clienttesting.Action) (bool, runtime.Object, error) {
		lookups++
		return false, nil, nil
	})
	for i := range 5 {
		here := claim(fmt.Sprintf("here-%d", i))
		here.Spec.StorageClassName = &class.Name
		f.ctrl.ShouldProvision(context.Background(), here)
	}
	select {
	case ev := <-events.Events:
		t.Errorf("extra event %q (repeated, or for a node that runs the plugin)", ev)
	default:
	}
	if lookups != 1 {
		t.Errorf("%d CSINode lookups for 5 claims on a node that runs the plugin, want 1", lookups)
	}

	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	for _, tc := range []struct {
		name   string
		params map[string]string
		want   string
	}{
		{"local-typo", map[string]string{"backend": "local", "bsaePath": "/x"}, `"bsaePath"`},
		{"nfs-typo", map[string]string{"backend": "nfs", "server": "nfs.example", "share": "/export", "onDelte": "retain"}, `"onDelte"`},
		{"local-good", map[string]string{"backend": "local", "basePath": f.base}, ""},
		{"nfs-good", map[string]string{"backend": "nfs", "server": "nfs.example", "share": "/export"}, ""},
	} {
		f.classes.Add(&storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: tc.name}, Provisioner: testDriver, Parameters: tc.params, VolumeBindingMode: &wffc})
		c := claim(tc.name)
		delete(c.Annotations, annSelectedNode)
		c.Spec.StorageClassName = &tc.name
		// The lib asks on every update and resync: one event per period.
		f.ctrl.ShouldProvision(context.Background(), c)
		f.ctrl.ShouldProvision(context.Background(), c)
		var got []string
		for len(events.Events) > 0 {
			got = append(got, <-events.Events)
		}
		switch {
		case tc.want == "" && len(got) != 0:
			t.Errorf("%s: events %q, want none", tc.name, got)
		case tc.want != "" && (len(got) != 1 || !strings.Contains(got[0], "cannot provision this claim") || !strings.Contains(got[0], tc.want)):
			t.Errorf("%s: events %q, want one naming %s", tc.name, got, tc.want)
		}
	}
	if len(f.mounter.GetLog()) != 0 {
		t.Errorf("checking claims mounted something: %v", f.mounter.GetLog())
	}
}

// Which claims the node instance takes. A claim being deleted, none: its volume would be
// released at once, and a clone's copy, cancelled when the deletion began, would start again.
// A claim placed on the node and handed to dirpv can reach the node instance before the class
// it names does (two watches): the node takes it, so that the lib retries it once the class is
// known instead of at the next resync; one handed to another provisioner, or placed on another
// node, stays someone else's.
func TestNodeShouldProvision(t *testing.T) {
	f := newFixture(t)
	known := f.localClass(nil).Name
	for _, c := range []struct {
		class, node, provisioner string
		deleting, want           bool
	}{
		{known, testNode, "", false, true},
		{known, testNode, "", true, false},
		{"not-yet-known", testNode, testDriver, false, true},
		{"not-yet-known", testNode, "rancher.io/local-path", false, false},
		{"not-yet-known", "node-b", testDriver, false, false},
		{"not-yet-known", testNode, "", false, false},
	} {
		pvc := claim("c")
		pvc.Spec.StorageClassName = &c.class
		pvc.Annotations[annSelectedNode] = c.node
		if c.provisioner != "" {
			pvc.Annotations[annStorageProvisioner] = c.provisioner
		}
		if c.deleting {
			pvc.DeletionTimestamp = &metav1.Time{Time: time.Now()}
		}
		if got := f.node.ShouldProvision(context.Background(), pvc); got != c.want {
			t.Errorf("class %s, node %s, provisioner %q, being deleted %t: ShouldProvision = %t, want %t", c.class, c.node, c.provisioner, c.deleting, got, c.want)
		}
	}
}
