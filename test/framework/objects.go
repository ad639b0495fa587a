package framework

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// must stops the test on err: the suites' object helpers fail their caller at once.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// NewNamespace creates a namespace named <suite>-<random> for one test and deletes it after
// the test.
func (s *Suite) NewNamespace(t testing.TB) string {
	t.Helper()
	ns, err := s.Client.CoreV1().Namespaces().Create(context.Background(),
		&v1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: s.Options.Name + "-"}}, metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		s.Client.CoreV1().Namespaces().Delete(context.Background(), ns.Name, metav1.DeleteOptions{})
	})
	return ns.Name
}

// ClassOption changes a StorageClass made by NewClass.
type ClassOption func(*storagev1.StorageClass)

// Immediate binds the class's claims at once, without waiting for a pod.
func Immediate(c *storagev1.StorageClass) {
	c.VolumeBindingMode = ptr.To(storagev1.VolumeBindingImmediate)
}

// ReclaimRetain keeps the class's PVs when their claims are deleted.
func ReclaimRetain(c *storagev1.StorageClass) {
	c.ReclaimPolicy = ptr.To(v1.PersistentVolumeReclaimRetain)
}

// AllowVolumeExpansion lets the class's claims grow.
func AllowVolumeExpansion(c *storagev1.StorageClass) {
	c.AllowVolumeExpansion = ptr.To(true)
}

// MountOptions sets the class's mountOptions.
func MountOptions(opts ...string) ClassOption {
	return func(c *storagev1.StorageClass) { c.MountOptions = opts }
}

// Provisioner sets the class's provisioner (dirpv.io by default).
func Provisioner(name string) ClassOption {
	return func(c *storagev1.StorageClass) { c.Provisioner = name }
}

// NewClass returns a dirpv.io StorageClass with the given parameters, binding claims on first
// consumer (what local classes require) unless an option says otherwise.
func NewClass(name string, params map[string]string, opts ...ClassOption) *storagev1.StorageClass {
	c := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: name},
		Provisioner:       "dirpv.io",
		Parameters:        params,
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// CreateClass creates NewClass(name, params, opts...) and deletes it after the test.
func (s *Suite) CreateClass(t testing.TB, name string, params map[string]string, opts ...ClassOption) *storagev1.StorageClass {
	t.Helper()
	c, err := s.Client.StorageV1().StorageClasses().Create(context.Background(), NewClass(name, params, opts...), metav1.CreateOptions{})
	must(t, err)
	t.Cleanup(func() {
		s.Client.StorageV1().StorageClasses().Delete(context.Background(), c.Name, metav1.DeleteOptions{})
	})
	return c
}

// ClaimOption changes a claim made by NewClaim.
type ClaimOption func(*v1.PersistentVolumeClaim)

// OnNode sets the annotation the scheduler sets on a WaitForFirstConsumer claim once it placed
// the pod, for claims made without a pod.
func OnNode(node string) ClaimOption {
	return Annotation("volume.kubernetes.io/selected-node", node)
}

// AccessModes sets the claim's access modes (ReadWriteOnce by default).
func AccessModes(m ...v1.PersistentVolumeAccessMode) ClaimOption {
	return func(c *v1.PersistentVolumeClaim) { c.Spec.AccessModes = m }
}

// Annotation sets an annotation on the claim.
func Annotation(k, v string) ClaimOption {
	return func(c *v1.PersistentVolumeClaim) {
		if c.Annotations == nil {
			c.Annotations = map[string]string{}
		}
		c.Annotations[k] = v
	}
}

// Request sets the claim's storage request (1Gi by default), e.g. "16Mi".
func Request(size string) ClaimOption {
	return func(c *v1.PersistentVolumeClaim) {
		c.Spec.Resources.Requests = v1.ResourceList{v1.ResourceStorage: resource.MustParse(size)}
	}
}

// NewClaim returns a 1Gi ReadWriteOnce claim of class; with class "" it names no class, so
// that the default class is what it gets, as for a user.
func NewClaim(ns, name, class string, opts ...ClaimOption) *v1.PersistentVolumeClaim {
	c := &v1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PersistentVolumeClaimSpec{
			AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			Resources:   v1.VolumeResourceRequirements{Requests: v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if class != "" {
		c.Spec.StorageClassName = &class
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// CreateClaim creates NewClaim(ns, name, class, opts...); the test's namespace takes it away.
func (s *Suite) CreateClaim(t testing.TB, ns, name, class string, opts ...ClaimOption) *v1.PersistentVolumeClaim {
	t.Helper()
	c, err := s.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), NewClaim(ns, name, class, opts...), metav1.CreateOptions{})
	must(t, err)
	return c
}

// CreatePod creates pod; the test's namespace takes it away.
func (s *Suite) CreatePod(t testing.TB, pod *v1.Pod) *v1.Pod {
	t.Helper()
	p, err := s.Client.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{})
	must(t, err)
	return p
}

// BusyboxPod is a pod of the node cluster's busybox image (never pulled) that runs script once
// with the claim mounted at /data.
func (s *Suite) BusyboxPod(ns, name, claim, script string, readOnly bool) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			RestartPolicy:                 v1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []v1.Container{{
				Name:            "c",
				Image:           s.Cluster.BusyboxImage,
				ImagePullPolicy: v1.PullNever,
				Command:         []string{"sh", "-c", script},
				VolumeMounts:    []v1.VolumeMount{{Name: "data", MountPath: "/data"}},
			}},
			Volumes: []v1.Volume{{Name: "data", VolumeSource: v1.VolumeSource{
				PersistentVolumeClaim: &v1.PersistentVolumeClaimVolumeSource{ClaimName: claim, ReadOnly: readOnly},
			}}},
		},
	}
}

// ReplaceClass replaces the class name, another provisioner's, by the dirpv class that the
// dirpv binary's convert-class with flags makes of it, as docs/migrating.md tells users to:
//
//	kubectl get storageclass NAME -o yaml | dirpv convert-class FLAGS | kubectl replace --force -f -
func ReplaceClass(ctx context.Context, c kubernetes.Interface, dirpv, name string, flags ...string) (*storagev1.StorageClass, error) {
	old, err := c.StorageV1().StorageClasses().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	old.APIVersion, old.Kind = "storage.k8s.io/v1", "StorageClass" // as kubectl prints it
	in, err := yaml.Marshal(old)
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, dirpv, append([]string{"convert-class"}, flags...)...)
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("dirpv convert-class %v: %w\n%s", flags, err, stderr.String())
	}
	var class storagev1.StorageClass
	if err := yaml.UnmarshalStrict(out, &class); err != nil {
		return nil, fmt.Errorf("dirpv convert-class wrote %w:\n%s", err, out)
	}
	// kubectl replace --force: delete, wait until gone, create.
	if err := c.StorageV1().StorageClasses().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		return nil, err
	}
	if err := WaitForDeleted(ctx, time.Minute, "StorageClass "+name, func(ctx context.Context) (string, error) {
		_, err := c.StorageV1().StorageClasses().Get(ctx, name, metav1.GetOptions{})
		return "", err
	}); err != nil {
		return nil, err
	}
	return c.StorageV1().StorageClasses().Create(ctx, &class, metav1.CreateOptions{})
}
