package framework

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/image"
	"github.com/dirpv/dirpv/test/release"
)

// Installation is dirpv installed into a test/cluster node cluster from deploy/, as a user
// would: the image imported into containerd, deploy/overlays/e2e-local applied.
type Installation struct {
	Objects []*unstructured.Unstructured
	// namespace is where namespaced objects that name none go, as with `kubectl apply -n`.
	namespace string
	dyn       dynamic.Interface
	mapper    *restmapper.DeferredDiscoveryRESTMapper
}

// Install builds the dirpv image, imports it into the cluster's containerd, renders
// deploy/overlays/e2e-local for the cluster's apiserver port and applies it, then waits for
// the node plugin to register with kubelet. nodeArgs are added to the node plugin's command line.
func Install(ctx context.Context, c *cluster.Cluster, logf func(string, ...any), nodeArgs ...string) (*Installation, error) {
	start := time.Now()
	tarPath, imageName, err := BuildDirpvImage(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.ImportImage(ctx, tarPath); err != nil {
		return nil, err
	}
	logf("image %s built and imported in %s", imageName, time.Since(start).Round(time.Millisecond))
	return InstallImage(ctx, c, imageName, c.NodeName, 2*time.Minute, logf, nodeArgs...)
}

// BuildDirpvImage builds dirpv's image from this checkout as users get it (test/image) and
// returns its tar and its name.
func BuildDirpvImage(ctx context.Context) (tarPath, imageName string, err error) {
	tarPath, imageName, err = image.WriteDirpvTar(ctx, image.DirpvOptions{Tag: "local", ModuleDir: RepoRoot()})
	if err != nil {
		return "", "", fmt.Errorf("build dirpv image: %w", err)
	}
	return tarPath, imageName, nil
}

// InstallRelease builds dirpv's release into dir as make release does (test/release: the
// linux/amd64 + linux/arm64 image index, the manifests pinned to its digest), imports the
// image into the cluster's containerd under the name the manifests give it, and applies the
// release's kind manifest with deploy/overlays/e2e-local's adaptations to this cluster: what
// a user of the release gets, on the cluster the tests have. It waits for the node plugin to
// register with kubelet. nodeArgs are added to the node plugin's command line.
func InstallRelease(ctx context.Context, c *cluster.Cluster, dir string, logf func(string, ...any), nodeArgs ...string) (*Installation, *release.Release, error) {
	start := time.Now()
	rel, err := release.BuildLocal(ctx, dir, image.GitVersion(ctx, RepoRoot()), release.DefaultImageRoots())
	if err != nil {
		return nil, nil, err
	}
	if err := c.ImportImage(ctx, rel.Image.Tar); err != nil {
		return nil, nil, err
	}
	// No registry to pull from: the image, imported as ghcr.io/dirpv/dirpv:<version>, also
	// gets the name by digest that the manifests use.
	if err := c.TagImage(ctx, rel.Image.Name, rel.ImageRef); err != nil {
		return nil, nil, err
	}
	logf("release %s (%s) built and imported in %s", rel.Version, rel.ImageRef, time.Since(start).Round(time.Millisecond))
	kind, err := os.ReadFile(filepath.Join(rel.Dir, release.KindManifest))
	if err != nil {
		return nil, nil, err
	}
	inst, err := install(ctx, c, deploy.E2ELocalOptions{Image: rel.ImageRef, Kind: kind, NodeArgs: nodeArgs}, c.NodeName, 2*time.Minute, logf)
	return inst, rel, err
}

// InstallImage renders deploy/overlays/e2e-local for the cluster's apiserver (its address and
// port) with imageName, which the node has already (BuildDirpvImage, imported), applies it
// and waits up to timeout for the node plugin to register with node's kubelet.
// nodeArgs are added to the node plugin's command line.
func InstallImage(ctx context.Context, c *cluster.Cluster, imageName, node string, timeout time.Duration, logf func(string, ...any), nodeArgs ...string) (*Installation, error) {
	return install(ctx, c, deploy.E2ELocalOptions{Image: imageName, NodeArgs: nodeArgs}, node, timeout, logf)
}

// install is InstallImage with the e2e-local overlay's options (the apiserver's are set here).
func install(ctx context.Context, c *cluster.Cluster, opts deploy.E2ELocalOptions, node string, timeout time.Duration, logf func(string, ...any)) (*Installation, error) {
	start := time.Now()
	objs, err := RenderInstall(ctx, c, opts)
	if err != nil {
		return nil, err
	}
	inst, err := ApplyObjects(ctx, c.Kubeconfig, objs, "")
	if err != nil {
		return nil, err
	}
	client, err := c.Client()
	if err != nil {
		return nil, err
	}
	if err := WaitForDriverRegistered(ctx, client, node, timeout); err != nil {
		return nil, err
	}
	logf("dirpv installed from deploy/overlays/e2e-local in %s", time.Since(start).Round(time.Millisecond))
	return inst, nil
}

// NodeLabelPolicy is deploy/'s MutatingAdmissionPolicy that labels placed claims of local
// classes with their node.
const NodeLabelPolicy = "deploy/components/node-label-policy/node-label-policy.yaml"

// ApplyFile server-side applies the objects of a manifest of this repository (path relative
// to its root) to the cluster of kubeconfig, as `kubectl apply --server-side -f` would; the
// Installation it returns deletes them again.
func ApplyFile(ctx context.Context, kubeconfig, path string) (*Installation, error) {
	data, err := os.ReadFile(filepath.Join(RepoRoot(), path))
	if err != nil {
		return nil, err
	}
	objs, err := deploy.Decode(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return ApplyObjects(ctx, kubeconfig, objs, "")
}

// ApplyObjects server-side applies objs (deploy.Decode's) in order to the cluster of
// kubeconfig, namespaced ones that name no namespace to namespace, as
// `kubectl apply -n namespace` would; the Installation it returns deletes them again.
func ApplyObjects(ctx context.Context, kubeconfig string, objs []*unstructured.Unstructured, namespace string) (*Installation, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	inst, err := newInstallation(cfg, objs)
	if err != nil {
		return nil, err
	}
	inst.namespace = namespace
	for _, o := range objs {
		if err := inst.apply(ctx, o); err != nil {
			return nil, err
		}
	}
	return inst, nil
}

// WaitNodeLabelPolicy waits until the API server applies NodeLabelPolicy to claims of class
// (a local WaitForFirstConsumer class): a policy takes effect once the API server's informers
// have it. It asks with dry-run creates in namespace, which leave nothing behind.
func WaitNodeLabelPolicy(ctx context.Context, c kubernetes.Interface, namespace, class string, timeout time.Duration) error {
	const node = "policy-probe"
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	var labels map[string]string
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		claim, err := c.CoreV1().PersistentVolumeClaims(namespace).Create(ctx, NewClaim(namespace, "policy-probe", class, OnNode(node)), dryRun)
		if err != nil {
			return false, err
		}
		labels = claim.Labels
		return labels["dirpv.io/node"] == node, nil
	})
	if err != nil {
		return fmt.Errorf("%s does not label a claim of class %s placed on %s (labels %v): %w", NodeLabelPolicy, class, node, labels, err)
	}
	return nil
}

// NodeWritePolicy is deploy/'s ValidatingAdmissionPolicy that lets a dirpv node pod's
// credentials write only the PersistentVolumes and claims of the pod's node.
const NodeWritePolicy = "deploy/components/node-write-policy/node-write-policy.yaml"

// WaitNodeWritePolicy waits until the API server applies NodeWritePolicy to c, a client with
// the credentials of a dirpv node pod: a policy takes effect once the API server's informers
// have it. It asks with dry-run creates of a PersistentVolume of a node that is not node
// (which the policy refuses), which leave nothing behind.
func WaitNodeWritePolicy(ctx context.Context, c kubernetes.Interface, node string, timeout time.Duration) error {
	probe := LocalPV("policy-probe", "not-"+node)
	dryRun := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		_, err := c.CoreV1().PersistentVolumes().Create(ctx, probe, dryRun)
		if err == nil {
			return false, fmt.Errorf("node %s's credentials may create a PersistentVolume of node %s", node, "not-"+node)
		}
		if apierrors.IsForbidden(err) && strings.Contains(err.Error(), "dirpv-node-writes") {
			return true, nil
		}
		return false, err
	})
	if err != nil {
		return fmt.Errorf("%s is not in effect: %w", NodeWritePolicy, err)
	}
	return nil
}

// LocalPV returns a PersistentVolume of a local dirpv volume on node as dirpv node makes them
// (provisioner.buildPV) on a node whose kubernetes.io/hostname label is its name, in no class.
// Its names are spelled out, not taken from provisioner/ and volume/: the framework is imported
// by their tests. node must be a valid label value (dirpv hashes longer names for the label).
func LocalPV(name, node string) *corev1.PersistentVolume {
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Annotations: map[string]string{"dirpv.io/node": node, "dirpv.io/on-delete": "retain"},
			Labels:      map[string]string{"dirpv.io/node": node},
		},
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver:           "dirpv.io",
				VolumeHandle:     "local:" + name,
				VolumeAttributes: map[string]string{"backend": "local", "basePath": "/var/lib/dirpv", "path": name},
			}},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{{
					Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{node},
				}}}},
			}},
		},
	}
}

func (inst *Installation) resource(o *unstructured.Unstructured) (dynamic.ResourceInterface, error) {
	gvk := o.GroupVersionKind()
	m, err := inst.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		return nil, fmt.Errorf("map %s: %w", gvk, err)
	}
	if m.Scope.Name() == "namespace" {
		if o.GetNamespace() == "" {
			o.SetNamespace(inst.namespace)
		}
		return inst.dyn.Resource(m.Resource).Namespace(o.GetNamespace()), nil
	}
	return inst.dyn.Resource(m.Resource), nil
}

// apply server-side applies one object, as `kubectl apply --server-side` would. An object of
// a kind the API server does not serve yet (a custom resource whose CRD was applied just
// before) is waited for, as kubectl's users retry.
func (inst *Installation) apply(ctx context.Context, o *unstructured.Unstructured) error {
	var r dynamic.ResourceInterface
	err := Poll(ctx, time.Minute, func(context.Context) (bool, error) {
		var err error
		if r, err = inst.resource(o); meta.IsNoMatchError(errors.Unwrap(err)) {
			inst.mapper.Reset()
		}
		return err == nil, err
	})
	if err != nil {
		return err
	}
	data, err := o.MarshalJSON()
	if err != nil {
		return err
	}
	if _, err := r.Patch(ctx, o.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{FieldManager: "dirpv-test", Force: ptr.To(true)}); err != nil {
		return fmt.Errorf("apply %s %s: %w", o.GetKind(), o.GetName(), err)
	}
	return nil
}

// Installed returns the Installation of objs, which another tool applied (helm, from a chart
// that renders the same objects), so that they are looked at and uninstalled as Install's are.
func Installed(kubeconfig string, objs []*unstructured.Unstructured) (*Installation, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	return newInstallation(cfg, objs)
}

// Existing returns those of the Installation's objects that the cluster has.
func (inst *Installation) Existing(ctx context.Context) ([]*unstructured.Unstructured, error) {
	var got []*unstructured.Unstructured
	for _, o := range inst.Objects {
		r, err := inst.resource(o)
		if meta.IsNoMatchError(errors.Unwrap(err)) {
			continue // a kind the API server does not serve (its CRD is gone): none there
		}
		if err != nil {
			return nil, err
		}
		switch _, err := r.Get(ctx, o.GetName(), metav1.GetOptions{}); {
		case err == nil:
			got = append(got, o)
		case !apierrors.IsNotFound(err):
			return nil, fmt.Errorf("get %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return got, nil
}

// Uninstall stops dirpv's pods, then deletes the rest of what Install applied, in reverse
// order, and waits until it is gone. The workloads go first, and their pods must be gone
// before their RBAC is deleted: a pod still shutting down would otherwise make calls that
// RBAC refuses, which is what a user would see in its logs, and what the RBAC audit would
// rightly count against deploy/.
func (inst *Installation) Uninstall(ctx context.Context) error {
	objs := slices.Clone(inst.Objects)
	slices.Reverse(objs)
	isWorkload := func(o *unstructured.Unstructured) bool {
		return o.GetKind() == "Deployment" || o.GetKind() == "DaemonSet" || o.GetKind() == "StatefulSet"
	}
	workloads := slices.DeleteFunc(slices.Clone(objs), func(o *unstructured.Unstructured) bool { return !isWorkload(o) })
	if err := inst.deleteAndWait(ctx, workloads); err != nil {
		return err
	}
	if err := inst.waitPodsGone(ctx, workloads); err != nil {
		return err
	}
	return inst.deleteAndWait(ctx, slices.DeleteFunc(objs, isWorkload))
}

// deleteAndWait deletes objs with foreground propagation, so that a workload is gone only
// once its pods are, and waits until none of them exists.
func (inst *Installation) deleteAndWait(ctx context.Context, objs []*unstructured.Unstructured) error {
	fg := metav1.DeletePropagationForeground
	for _, o := range objs {
		r, err := inst.resource(o)
		if meta.IsNoMatchError(errors.Unwrap(err)) {
			continue // a kind the API server does not serve (its CRD is gone): none there
		}
		if err != nil {
			return err
		}
		if err := r.Delete(ctx, o.GetName(), metav1.DeleteOptions{PropagationPolicy: &fg}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return Poll(ctx, 2*time.Minute, func(ctx context.Context) (bool, error) {
		for _, o := range objs {
			r, err := inst.resource(o)
			if meta.IsNoMatchError(errors.Unwrap(err)) {
				continue
			}
			if err != nil {
				return false, err
			}
			got, err := r.Get(ctx, o.GetName(), metav1.GetOptions{})
			switch {
			case err == nil:
				return false, fmt.Errorf("%s %s still exists (deleted at %v, finalizers %v, owners %v)", o.GetKind(), o.GetName(),
					got.GetDeletionTimestamp(), got.GetFinalizers(), got.GetOwnerReferences())
			case !apierrors.IsNotFound(err):
				return false, fmt.Errorf("get %s %s: %w", o.GetKind(), o.GetName(), err)
			}
		}
		return true, nil
	})
}

// waitPodsGone waits until no pod is left in the workloads' namespaces. A pod object is
// removed only once kubelet has seen its containers exit, so after this no dirpv process runs.
func (inst *Installation) waitPodsGone(ctx context.Context, workloads []*unstructured.Unstructured) error {
	pods := inst.dyn.Resource(corev1.SchemeGroupVersion.WithResource("pods"))
	namespaces := map[string]bool{}
	for _, o := range workloads {
		namespaces[o.GetNamespace()] = true
	}
	return Poll(ctx, 2*time.Minute, func(ctx context.Context) (bool, error) {
		for ns := range namespaces {
			list, err := pods.Namespace(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, fmt.Errorf("list pods in %s: %w", ns, err)
			}
			if len(list.Items) > 0 {
				return false, fmt.Errorf("%d pods still in namespace %s, e.g. %s", len(list.Items), ns, list.Items[0].GetName())
			}
		}
		return true, nil
	})
}

// WaitForDriverRegistered waits until kubelet lists dirpv.io in the node's CSINode object,
// which it does only after the plugin answered over its registration socket.
func WaitForDriverRegistered(ctx context.Context, client kubernetes.Interface, node string, timeout time.Duration) error {
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		n, err := client.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return slices.ContainsFunc(n.Spec.Drivers, func(d storagev1.CSINodeDriver) bool {
			return d.Name == "dirpv.io" && d.NodeID == node
		}), fmt.Errorf("CSINode drivers: %+v", n.Spec.Drivers)
	})
	if err != nil {
		return fmt.Errorf("dirpv.io not registered with kubelet on %s: %w", node, err)
	}
	return nil
}

// newInstallation returns an Installation of objs that applies and deletes them through the
// API server of cfg.
func newInstallation(cfg *rest.Config, objs []*unstructured.Unstructured) (*Installation, error) {
	inst := &Installation{Objects: objs}
	var err error
	if inst.dyn, err = dynamic.NewForConfig(cfg); err != nil {
		return nil, err
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, err
	}
	inst.mapper = restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	return inst, nil
}
