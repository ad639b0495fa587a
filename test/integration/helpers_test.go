package integration

import (
	"context"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

const timeout = 60 * time.Second

// newNamespace creates a namespace for one test and deletes it afterwards.
func newNamespace(t *testing.T) string {
	t.Helper()
	ns := &v1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "it-"}}
	ns, err := client.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		client.CoreV1().Namespaces().Delete(context.Background(), ns.Name, metav1.DeleteOptions{})
	})
	return ns.Name
}

type classOpt func(*storagev1.StorageClass)

func immediate(c *storagev1.StorageClass) { c.VolumeBindingMode = nil }

func reclaimRetain(c *storagev1.StorageClass) {
	r := v1.PersistentVolumeReclaimRetain
	c.ReclaimPolicy = &r
}

// localClass creates a local StorageClass with its own base directory and returns both.
func localClass(t *testing.T, params map[string]string, opts ...classOpt) (*storagev1.StorageClass, string) {
	t.Helper()
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 60 {
		name = name[len(name)-60:]
	}
	name = strings.Trim(name, "-")
	base := filepath.Join(baseRoot, name)
	p := map[string]string{"backend": "local", "basePath": base}
	for k, v := range params {
		p[k] = v
	}
	return createClass(t, name, p, opts...), base
}

func createClass(t *testing.T, name string, params map[string]string, opts ...classOpt) *storagev1.StorageClass {
	t.Helper()
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	c := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: name},
		Provisioner:       "dirpv.io",
		Parameters:        params,
		VolumeBindingMode: &wffc,
	}
	for _, o := range opts {
		o(c)
	}
	c, err := client.StorageV1().StorageClasses().Create(context.Background(), c, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		client.StorageV1().StorageClasses().Delete(context.Background(), c.Name, metav1.DeleteOptions{})
	})
	return c
}

type claimOpt func(*v1.PersistentVolumeClaim)

// onNode sets the annotation the scheduler sets on a WaitForFirstConsumer claim, for tests
// that create many claims without a pod each.
func onNode(node string) claimOpt {
	return func(c *v1.PersistentVolumeClaim) {
		if c.Annotations == nil {
			c.Annotations = map[string]string{}
		}
		c.Annotations["volume.kubernetes.io/selected-node"] = node
	}
}

func accessModes(m ...v1.PersistentVolumeAccessMode) claimOpt {
	return func(c *v1.PersistentVolumeClaim) { c.Spec.AccessModes = m }
}

func newClaim(ns, name, class string, opts ...claimOpt) *v1.PersistentVolumeClaim {
	c := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PersistentVolumeClaimSpec{
			StorageClassName: &class,
			AccessModes:      []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Resources:        v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

func createClaim(t *testing.T, ns, name, class string, opts ...claimOpt) *v1.PersistentVolumeClaim {
	t.Helper()
	c, err := client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), newClaim(ns, name, class, opts...), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// createPod creates a pod using the claim, pinned to node through a node selector so that the
// real scheduler (not the test) makes the placement and sets the claim's selected node.
func createPod(t *testing.T, ns, name, claim, node string) {
	t.Helper()
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": "host-" + node},
			Containers:   []v1.Container{{Name: "c", Image: "busybox", Command: []string{"sleep", "3600"}}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			}}},
		},
	}
	if _, err := client.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func waitBound(t *testing.T, ns, name string) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
	t.Helper()
	ctx := context.Background()
	pvc, err := framework.WaitForPVCBound(ctx, client, ns, name, timeout)
	if err != nil {
		t.Fatalf("%v\n--- node-a log tail:\n%s", err, nodeProc.Tail(3000))
	}
	pv, err := client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc, pv
}

func deleteClaim(t *testing.T, ns, name string) {
	t.Helper()
	if err := client.CoreV1().PersistentVolumeClaims(ns).Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// waitPVGone waits until the PV object is deleted, i.e. the provisioner finished Delete.
func waitPVGone(t *testing.T, name string) {
	t.Helper()
	if err := framework.WaitForPVDeleted(context.Background(), client, name, timeout); err != nil {
		t.Fatal(err)
	}
}

// entries lists a directory's names, sorted; a missing directory has none.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, d := range des {
		names = append(names, d.Name())
	}
	sort.Strings(names)
	return names
}
