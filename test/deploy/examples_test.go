package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	snapscheme "github.com/kubernetes-csi/external-snapshotter/client/v8/clientset/versioned/scheme"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/dirpv/dirpv/test/cluster"
)

// strictDecoder refuses unknown and duplicate fields, as `kubectl apply --validate=strict` does.
// It knows the built-in types and the snapshot API's.
var strictDecoder = func() runtime.Decoder {
	s := runtime.NewScheme()
	if err := scheme.AddToScheme(s); err != nil {
		panic(err)
	}
	if err := snapscheme.AddToScheme(s); err != nil {
		panic(err)
	}
	return json.NewSerializerWithOptions(json.DefaultMetaFactory, s, s, json.SerializerOptions{Yaml: true, Strict: true})
}()

// decodeStrict decodes every document of a manifest file into its API type.
func decodeStrict(t *testing.T, file string) []runtime.Object {
	t.Helper()
	data, err := os.ReadFile(file)
	must(t, err)
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []runtime.Object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		obj, _, err := strictDecoder.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%s: %v\n%s", file, err, doc)
		}
		objs = append(objs, obj)
	}
}

func stripComments(doc []byte) []byte {
	var out []byte
	for _, l := range bytes.Split(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			out = append(append(out, l...), '\n')
		}
	}
	return out
}

// TestExamples: every example is valid, self-consistent, and usable with deploy/: claims use a
// class from the same file or from deploy/ (the default class when they name none), pods use
// claims from the same file, access modes suit the backend, local classes wait for the pod
// and keep to a basePath the node DaemonSet mounts.
func TestExamples(t *testing.T) {
	kustomize, _ := tools(t)
	deployed := map[string]*storagev1.StorageClass{}
	var defaultClass string
	var nodeMounts []string
	for _, overlay := range []string{"deploy/overlays/kind", "deploy/overlays/nfs"} {
		objs := kustomizeObjs(t, kustomize, overlay)
		for name, sc := range storageClasses(t, objs) {
			deployed[name] = sc
			if sc.Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
				defaultClass = name
			}
		}
		for _, m := range container(t, daemonSet(t, objs).Spec.Template.Spec).VolumeMounts {
			nodeMounts = append(nodeMounts, m.MountPath)
		}
	}
	if defaultClass == "" {
		t.Fatal("deploy/overlays/kind has no default class")
	}
	snapshotClasses := map[string]bool{}
	for _, name := range kustomizeObjs(t, kustomize, "test/deploy/testdata/snapshots").ofKind("VolumeSnapshotClass") {
		snapshotClasses[name] = true
	}

	files, err := filepath.Glob(repoPath(t, "examples/*.yaml"))
	if err != nil || len(files) < 6 {
		t.Fatalf("examples: %v %v", files, err)
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, _ := os.ReadFile(file)
			if !bytes.HasPrefix(data, []byte("# ")) {
				t.Error("an example starts with a comment saying what it shows and how to use it")
			}
			classes := maps.Clone(deployed)
			claims := map[string]*corev1.PersistentVolumeClaim{}
			snapshots := map[string]*snapshotv1.VolumeSnapshot{}
			var pods []*corev1.Pod
			for _, obj := range decodeStrict(t, file) {
				switch o := obj.(type) {
				case *storagev1.StorageClass:
					if deployed[o.Name] != nil {
						t.Errorf("class %s collides with deploy/'s", o.Name)
					}
					if o.Annotations["storageclass.kubernetes.io/is-default-class"] == "true" {
						t.Errorf("class %s: an example must not take over the default class", o.Name)
					}
					if o.Provisioner != "dirpv.io" {
						t.Errorf("class %s provisioner %s", o.Name, o.Provisioner)
					}
					checkParameters(t, o)
					classes[o.Name] = o
				case *corev1.PersistentVolumeClaim:
					claims[o.Name] = o
				case *corev1.Pod:
					pods = append(pods, o)
				case *snapshotv1.VolumeSnapshot:
					snapshots[o.Name] = o
				default:
					t.Errorf("unexpected %T in an example", obj)
				}
			}
			for _, sc := range classes {
				if sc.Parameters["backend"] != "local" {
					continue
				}
				if sc.VolumeBindingMode == nil || *sc.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
					t.Errorf("local class %s must be WaitForFirstConsumer", sc.Name)
				}
				bp := sc.Parameters["basePath"]
				if bp == "" {
					bp = "/var/lib/dirpv"
				}
				if !slices.Contains(nodeMounts, bp) {
					t.Errorf("class %s: basePath %s is not mounted by the node DaemonSet (%v)", sc.Name, bp, nodeMounts)
				}
			}
			for _, vs := range snapshots {
				if c := vs.Spec.VolumeSnapshotClassName; c == nil || !snapshotClasses[*c] {
					t.Errorf("VolumeSnapshot %s: class %v is not one of deploy/components/snapshots' %v", vs.Name, c, snapshotClasses)
				}
				if src := vs.Spec.Source.PersistentVolumeClaimName; src == nil || claims[*src] == nil {
					t.Errorf("VolumeSnapshot %s: source claim %v is not in the example", vs.Name, src)
				}
			}
			for _, pvc := range claims {
				if ds := pvc.Spec.DataSource; ds != nil && ds.Kind == "VolumeSnapshot" && snapshots[ds.Name] == nil {
					t.Errorf("claim %s: VolumeSnapshot %s is not in the example", pvc.Name, ds.Name)
				}
				name := defaultClass
				if pvc.Spec.StorageClassName != nil {
					name = *pvc.Spec.StorageClassName
				}
				sc := classes[name]
				if sc == nil {
					t.Errorf("claim %s: class %s exists neither in the example nor in deploy/", pvc.Name, name)
					continue
				}
				for _, m := range pvc.Spec.AccessModes {
					if sc.Parameters["backend"] == "local" && m != corev1.ReadWriteOnce && m != corev1.ReadWriteOncePod {
						t.Errorf("claim %s: %s on local class %s", pvc.Name, m, name)
					}
				}
				if pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode != corev1.PersistentVolumeFilesystem {
					t.Errorf("claim %s: volumeMode %s", pvc.Name, *pvc.Spec.VolumeMode)
				}
				if strings.Contains(sc.Parameters["pathPattern"], "labels['") {
					for _, part := range strings.Split(sc.Parameters["pathPattern"], "labels['")[1:] {
						label, _, _ := strings.Cut(part, "']")
						if pvc.Labels[label] == "" {
							t.Errorf("claim %s lacks label %s that class %s's pathPattern needs", pvc.Name, label, name)
						}
					}
				}
			}
			used := map[string]bool{}
			for _, pod := range pods {
				for _, c := range pod.Spec.Containers {
					checkExampleImage(t, pod.Name, c)
				}
				for _, v := range pod.Spec.Volumes {
					if v.PersistentVolumeClaim == nil {
						continue
					}
					used[v.PersistentVolumeClaim.ClaimName] = true
					if claims[v.PersistentVolumeClaim.ClaimName] == nil {
						t.Errorf("pod %s: claim %s is not in the example", pod.Name, v.PersistentVolumeClaim.ClaimName)
					}
				}
			}
			for name := range claims {
				if !used[name] {
					t.Errorf("claim %s is used by no pod in the example", name)
				}
			}
		})
	}
}

// nodeBusybox is the busybox name every test/cluster node (and so `make up`'s) has, so that
// examples naming it run there without a registry.
var nodeBusybox = name.MustParseReference(cluster.ExamplesBusyboxImage)

// checkExampleImage: an example's container runs on `make up`'s node as written, i.e. names
// the node's busybox and lets kubelet use it rather than pull it.
func checkExampleImage(t *testing.T, pod string, c corev1.Container) {
	t.Helper()
	ref, err := name.ParseReference(c.Image)
	if err != nil {
		t.Errorf("pod %s container %s: image %q: %v", pod, c.Name, c.Image, err)
		return
	}
	if ref.Name() != nodeBusybox.Name() {
		t.Errorf("pod %s container %s: image %s is not %s, the one `make up`'s node has (test/cluster ExamplesBusyboxImage)", pod, c.Name, c.Image, cluster.ExamplesBusyboxImage)
	}
	if c.ImagePullPolicy == corev1.PullAlways {
		t.Errorf("pod %s container %s: imagePullPolicy Always needs a registry", pod, c.Name)
	}
}
