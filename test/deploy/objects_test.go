package deploy

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
)

// tools returns the pinned kustomize and helm, building them when missing (a few minutes cold;
// `make deploy-tools` does it ahead). -short skips instead of building.
func tools(t *testing.T) (kustomize, helm string) {
	t.Helper()
	var paths [2]string
	for i, name := range []string{"kustomize", "helm"} {
		p, err := Tool(t.Context(), name, !testing.Short())
		if errors.Is(err, ErrToolMissing) {
			t.Skipf("-short and %s is not built yet: %v", name, err)
		}
		must(t, err)
		paths[i] = p
	}
	return paths[0], paths[1]
}

// chartAppVersion is deploy/helm/dirpv's appVersion, the release the chart installs.
func chartAppVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(repoPath(t, "deploy/helm/dirpv/Chart.yaml"))
	must(t, err)
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	if err := utilyaml.Unmarshal(data, &chart); err != nil || chart.AppVersion == "" {
		t.Fatalf("Chart.yaml appVersion %q: %v", chart.AppVersion, err)
	}
	return chart.AppVersion
}

func repoPath(t *testing.T, rel string) string {
	t.Helper()
	root, err := RepoDir()
	must(t, err)
	return root + "/" + rel
}

func kustomizeObjs(t *testing.T, kustomize, dir string) objects {
	t.Helper()
	out, err := Kustomize(t.Context(), kustomize, repoPath(t, dir))
	must(t, err)
	return decode(t, out)
}

func helmObjs(t *testing.T, helm string, valuesFiles []string, set ...string) objects {
	t.Helper()
	out, err := HelmTemplate(t.Context(), helm, "dirpv", valuesFiles, set...)
	must(t, err)
	return decode(t, out)
}

// objects are rendered manifests keyed by "Kind namespace/name".
type objects map[string]*unstructured.Unstructured

func key(u *unstructured.Unstructured) string {
	return u.GetKind() + " " + u.GetNamespace() + "/" + u.GetName()
}

func decode(t *testing.T, data []byte) objects {
	t.Helper()
	list, err := Decode(data)
	must(t, err)
	objs := objects{}
	for _, u := range list {
		if _, dup := objs[key(u)]; dup {
			t.Errorf("%s rendered twice", key(u))
		}
		objs[key(u)] = u
	}
	return objs
}

func (o objects) keys() []string { return slices.Sorted(maps.Keys(o)) }

// ofKind returns the names of the objects of one kind, sorted.
func (o objects) ofKind(kind string) []string {
	var names []string
	for _, u := range o {
		if u.GetKind() == kind {
			names = append(names, u.GetName())
		}
	}
	slices.Sort(names)
	return names
}

// typed converts every object to its Go type, failing on a field the API does not know (a
// typo such as mountPropogation would otherwise be dropped silently by the apiserver).
func typed(t *testing.T, u *unstructured.Unstructured) runtime.Object {
	t.Helper()
	obj, err := scheme.Scheme.New(u.GroupVersionKind())
	if err != nil {
		t.Fatalf("%s: %v", key(u), err)
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(u.Object, obj, true); err != nil {
		t.Fatalf("%s: %v", key(u), err)
	}
	return obj
}

func get[T runtime.Object](t *testing.T, o objects, k string) T {
	t.Helper()
	u, ok := o[k]
	if !ok {
		t.Fatalf("no %s among %v", k, o.keys())
	}
	obj, ok := typed(t, u).(T)
	if !ok {
		t.Fatalf("%s: unexpected type %T", k, typed(t, u))
	}
	return obj
}

func deployment(t *testing.T, o objects) *appsv1.Deployment {
	return get[*appsv1.Deployment](t, o, "Deployment dirpv/dirpv-controller")
}

func daemonSet(t *testing.T, o objects) *appsv1.DaemonSet {
	return get[*appsv1.DaemonSet](t, o, "DaemonSet dirpv/dirpv-node")
}

func storageClasses(t *testing.T, o objects) map[string]*storagev1.StorageClass {
	classes := map[string]*storagev1.StorageClass{}
	for _, name := range o.ofKind("StorageClass") {
		classes[name] = get[*storagev1.StorageClass](t, o, "StorageClass /"+name)
	}
	return classes
}

func container(t *testing.T, spec corev1.PodSpec) corev1.Container {
	t.Helper()
	if len(spec.Containers) != 1 || len(spec.InitContainers) != 0 {
		t.Fatalf("want exactly one container, got %d (+%d init)", len(spec.Containers), len(spec.InitContainers))
	}
	return spec.Containers[0]
}

// httpPort is the container's port named http, where dirpv serves /healthz and /metrics.
func httpPort(c corev1.Container) int32 {
	for _, p := range c.Ports {
		if p.Name == "http" {
			return p.ContainerPort
		}
	}
	return 0
}

// podsSelected reports, for each workload (Deployment, DaemonSet) among o, whether sel
// matches its pods' labels.
func podsSelected(o objects, sel labels.Selector) map[string]bool {
	out := map[string]bool{}
	for k, u := range o {
		if u.GetKind() == "Deployment" || u.GetKind() == "DaemonSet" {
			lbls, _, _ := unstructured.NestedStringMap(u.Object, "spec", "template", "metadata", "labels")
			out[k] = sel.Matches(labels.Set(lbls))
		}
	}
	return out
}

func envValue(c corev1.Container, name string) (corev1.EnvVar, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e, true
		}
	}
	return corev1.EnvVar{}, false
}

// diff lists the paths at which a and b differ, for readable failures.
func diff(path string, a, b any) []string {
	switch av := a.(type) {
	case map[string]any:
		bv, ok := b.(map[string]any)
		if !ok {
			break
		}
		var out []string
		keys := slices.Collect(maps.Keys(av))
		for k := range bv {
			if _, ok := av[k]; !ok {
				keys = append(keys, k)
			}
		}
		slices.Sort(keys)
		for _, k := range keys {
			out = append(out, diff(path+"."+k, av[k], bv[k])...)
		}
		return out
	case []any:
		bv, ok := b.([]any)
		if !ok || len(av) != len(bv) {
			break
		}
		var out []string
		for i := range av {
			out = append(out, diff(fmt.Sprintf("%s[%d]", path, i), av[i], bv[i])...)
		}
		return out
	}
	if reflect.DeepEqual(a, b) {
		return nil
	}
	return []string{fmt.Sprintf("%s: %v != %v", path, a, b)}
}

func joinRule(r rbacv1.PolicyRule) string {
	sorted := func(s []string) []string { return slices.Sorted(slices.Values(s)) }
	return fmt.Sprintf("groups=%v resources=%v names=%v verbs=%v", sorted(r.APIGroups), sorted(r.Resources),
		sorted(r.ResourceNames), sorted(r.Verbs))
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
