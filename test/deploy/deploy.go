// Package deploy renders dirpv's manifests under deploy/ the way a user would, with the pinned
// kustomize and helm that tools.sh builds from the Go module proxy, and decodes the result into
// objects. Its tests check the kustomize and Helm variants against each other and against
// dirpv's requirements (least-privilege RBAC, mount propagation, ...); e2e tests use
// RenderE2ELocal to install dirpv on test/cluster's local cluster.
package deploy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsyaml "sigs.k8s.io/yaml"
)

// ErrToolMissing is returned by Tool when building is off and the tool is not cached yet.
var ErrToolMissing = errors.New("tool not built")

// RepoDir returns the root of the dirpv checkout this package was compiled from.
func RepoDir() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("deploy: cannot locate the source of package deploy")
	}
	root := filepath.Join(filepath.Dir(file), "..", "..")
	if _, err := os.Stat(filepath.Join(root, "deploy", "base", "kustomization.yaml")); err != nil {
		return "", fmt.Errorf("deploy: %s is not a dirpv checkout: %w", root, err)
	}
	return root, nil
}

// Tool returns the path of the pinned "helm", "kustomize" or "local-path-provisioner" (which
// the e2e tier runs as a neighbour), building it with tools.sh when it
// is missing and build is true (minutes when cold). With build false a missing tool gives
// ErrToolMissing.
func Tool(ctx context.Context, name string, build bool) (string, error) {
	root, err := RepoDir()
	if err != nil {
		return "", err
	}
	args := []string{filepath.Join(root, "test", "deploy", "tools.sh")}
	if !build {
		args = append(args, "--check")
	}
	cmd := exec.CommandContext(ctx, "bash", append(args, name)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		var exit *exec.ExitError
		if !build && errors.As(err, &exit) && exit.ExitCode() == 2 {
			return "", fmt.Errorf("%w: %s", ErrToolMissing, strings.TrimSpace(stderr.String()))
		}
		return "", fmt.Errorf("deploy: tools.sh %s: %w: %s", name, err, strings.TrimSpace(stderr.String()))
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1], nil
}

// Kustomize runs `kustomize build dir` with the pinned kustomize at path kustomizeBin.
func Kustomize(ctx context.Context, kustomizeBin, dir string) ([]byte, error) {
	return run(ctx, kustomizeBin, "build", dir)
}

// MutatingAdmissionPolicyAPI is the API version of the node-label policy's kind, as helm's
// --api-versions names it: Kubernetes 1.36 and newer serve it.
const MutatingAdmissionPolicyAPI = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"

// ValidatingAdmissionPolicyAPI is the API version of the node-write policy's kind, as helm's
// --api-versions names it: Kubernetes 1.30 and newer serve it, helm's built-in list does not.
const ValidatingAdmissionPolicyAPI = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"

// HelmTemplate runs `helm template dirpv deploy/helm/dirpv --namespace namespace` with the
// given values files and --set arguments ("key=value"), for a cluster that serves
// MutatingAdmissionPolicyAPI and ValidatingAdmissionPolicyAPI, as the clusters of this
// repository's tests do.
func HelmTemplate(ctx context.Context, helmBin, namespace string, valuesFiles []string, set ...string) ([]byte, error) {
	return HelmTemplateFor(ctx, helmBin, namespace, []string{MutatingAdmissionPolicyAPI, ValidatingAdmissionPolicyAPI}, valuesFiles, set...)
}

// HelmTemplateFor is HelmTemplate for a cluster that serves, beyond helm's built-in API
// versions, apiVersions ("group/version/Kind"). The output has the CRDs helm install would
// create from the crds/ directories of the chart's enabled subcharts, as well as the release's
// objects.
func HelmTemplateFor(ctx context.Context, helmBin, namespace string, apiVersions, valuesFiles []string, set ...string) ([]byte, error) {
	root, err := RepoDir()
	if err != nil {
		return nil, err
	}
	args := []string{"template", "dirpv", filepath.Join(root, "deploy", "helm", "dirpv"), "--namespace", namespace, "--include-crds"}
	for _, v := range apiVersions {
		args = append(args, "--api-versions", v)
	}
	for _, f := range valuesFiles {
		args = append(args, "--values", f)
	}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return Helm(ctx, helmBin, args...)
}

// Helm runs the pinned helm at helmBin with args and returns its output. helm writes its cache
// and config under $HOME unless told otherwise; keep the user's helm setup out of the run and
// the run out of it.
func Helm(ctx context.Context, helmBin string, args ...string) ([]byte, error) {
	tmp, err := os.MkdirTemp("", "dirpv-helm-")
	if err != nil {
		return nil, fmt.Errorf("deploy: %w", err)
	}
	defer os.RemoveAll(tmp)
	cmd := exec.CommandContext(ctx, helmBin, args...)
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(tmp, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(tmp, "config"),
		"HELM_DATA_HOME="+filepath.Join(tmp, "data"))
	return output(cmd)
}

// E2ELocalOptions parameterise RenderE2ELocal.
type E2ELocalOptions struct {
	// APIServerPort is the port of the apiserver on 127.0.0.1 (required).
	APIServerPort int
	// APIServerHost, if set, replaces the overlay's 127.0.0.1: the apiserver's address as the
	// node sees it, for a node on another kernel (a VM) than the control plane.
	APIServerHost string
	// Image replaces deploy/base's ghcr.io/dirpv/dirpv:<release>, e.g. with the name
	// WriteDirpvTar returned; it must have a tag or a digest. Empty keeps the release's.
	Image string
	// NodeArgs are added to the node plugin's command line (a test's --quota-check-period).
	NodeArgs []string
	// Kind, when set, is a rendered deploy/overlays/kind (a release's manifest, RenderOverlay's
	// output) that the overlay's adaptations are applied to instead of the tree's overlay.
	Kind []byte
	// Root is the checkout whose deploy/ is rendered (another commit's, for the upgrade
	// test); empty means this one.
	Root string
	// NoSurge replaces the Deployments one pod at a time (maxSurge 0): on the host network a
	// new pod wants its predecessor's port, which an older deploy/ did not account for, and
	// on one node it would wait for ever (docs/operations.md, "Downgrading").
	NoSurge bool
	// ChartSnapshots: the chart renders the snapshot objects itself (snapshots.enabled=true), so
	// E2ELocalPostRenderer leaves the overlay's components/snapshots out.
	ChartSnapshots bool
}

// RenderE2ELocal renders deploy/overlays/e2e-local for a cluster whose apiserver listens on
// 127.0.0.1:APIServerPort, returning multi-document YAML to apply. It writes, in a temporary
// directory, the kustomization a test would write by hand:
//
//	resources: [<relative path to repo>/deploy/overlays/e2e-local]
//	images: [{name: ghcr.io/dirpv/dirpv, newName: <repo part of Image>, newTag: <tag of Image>}]
//	        (or digest: instead of newTag for repo@sha256:...)
//	patches: one strategic-merge patch per workload setting env KUBERNETES_SERVICE_PORT (and
//	         KUBERNETES_SERVICE_HOST with APIServerHost)
func RenderE2ELocal(ctx context.Context, kustomizeBin string, opts E2ELocalOptions) ([]byte, error) {
	dir, err := os.MkdirTemp("", "dirpv-e2e-overlay-")
	if err != nil {
		return nil, fmt.Errorf("deploy: %w", err)
	}
	defer os.RemoveAll(dir)
	if err := writeE2ELocal(opts, dir); err != nil {
		return nil, err
	}
	return Kustomize(ctx, kustomizeBin, dir)
}

// E2ELocalPostRenderer writes into dir a helm post-renderer (helm install --post-renderer)
// that makes of the chart's output what RenderE2ELocal makes of a release's kind manifest
// (opts.Kind): the chart, rendered with snapshots.enabled false, stands for the kind overlay.
// It returns the post-renderer's path; dir must outlive its use.
func E2ELocalPostRenderer(kustomizeBin string, opts E2ELocalOptions, dir string) (string, error) {
	opts.Kind = []byte("# replaced by the chart's output\n")
	if err := writeE2ELocal(opts, dir); err != nil {
		return "", err
	}
	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
	script := "#!/bin/sh\nset -e\ncat > " + quote(filepath.Join(dir, "e2e-local", "rendered.yaml")) + "\n" +
		"exec " + quote(kustomizeBin) + " build " + quote(dir) + "\n"
	path := filepath.Join(dir, "post-render.sh")
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		return "", fmt.Errorf("deploy: %w", err)
	}
	return path, nil
}

// writeE2ELocal writes RenderE2ELocal's kustomization into dir.
func writeE2ELocal(opts E2ELocalOptions, dir string) error {
	if opts.APIServerPort <= 0 || opts.APIServerPort > 65535 {
		return fmt.Errorf("deploy: e2e-local: APIServerPort %d out of range", opts.APIServerPort)
	}
	root := opts.Root
	if root == "" {
		var err error
		if root, err = RepoDir(); err != nil {
			return err
		}
	}
	var err error
	env := "            - name: KUBERNETES_SERVICE_PORT\n              value: " + strconv.Quote(strconv.Itoa(opts.APIServerPort)) + "\n"
	if opts.APIServerHost != "" {
		if net.ParseIP(opts.APIServerHost) == nil {
			return fmt.Errorf("deploy: e2e-local: APIServerHost %q is not an IP address", opts.APIServerHost)
		}
		env += "            - name: KUBERNETES_SERVICE_HOST\n              value: " + strconv.Quote(opts.APIServerHost) + "\n"
	}
	var k strings.Builder
	e2eLocal := filepath.Join(root, "deploy", "overlays", "e2e-local")
	if opts.Kind != nil {
		var without []string
		if opts.ChartSnapshots {
			without = append(without, "../../components/snapshots")
		}
		if e2eLocal, err = rebaseOnRendered(e2eLocal, "../kind", opts.Kind, filepath.Join(dir, "e2e-local"), without...); err != nil {
			return err
		}
	}
	// kustomize refuses an absolute path to another kustomization; a relative one may climb.
	overlay, err := filepath.Rel(dir, e2eLocal)
	if err != nil {
		return fmt.Errorf("deploy: %w", err)
	}
	fmt.Fprintf(&k, "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\n", overlay)
	if opts.Image != "" {
		images, err := imagesField(opts.Image)
		if err != nil {
			return err
		}
		k.WriteString(images)
	}
	k.WriteString("patches:\n")
	for _, w := range []struct{ kind, name string }{{"Deployment", "dirpv-controller"}, {"DaemonSet", "dirpv-node"}, {"Deployment", "dirpv-snapshot-controller"}} {
		patch := fmt.Sprintf("apiVersion: apps/v1\nkind: %s\nmetadata:\n  name: %s\n  namespace: dirpv\n"+
			"spec:\n  template:\n    spec:\n      containers:\n        - name: dirpv\n          env:\n%s", w.kind, w.name, env)
		file := w.name + "-port.yaml"
		if err := os.WriteFile(filepath.Join(dir, file), []byte(patch), 0o644); err != nil {
			return fmt.Errorf("deploy: %w", err)
		}
		fmt.Fprintf(&k, "  - path: %s\n", file)
	}
	if len(opts.NodeArgs) > 0 {
		var ops []map[string]string
		for _, a := range opts.NodeArgs {
			ops = append(ops, map[string]string{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": a})
		}
		b, err := json.Marshal(ops)
		if err != nil {
			return fmt.Errorf("deploy: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dir, "node-args.json"), b, 0o644); err != nil {
			return fmt.Errorf("deploy: %w", err)
		}
		k.WriteString("  - path: node-args.json\n    target:\n      kind: DaemonSet\n      name: dirpv-node\n")
	}
	if opts.NoSurge {
		k.WriteString("  - patch: '[{\"op\": \"add\", \"path\": \"/spec/strategy\", \"value\": " +
			"{\"type\": \"RollingUpdate\", \"rollingUpdate\": {\"maxSurge\": 0, \"maxUnavailable\": 1}}}]'\n" +
			"    target:\n      kind: Deployment\n")
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k.String()), 0o644); err != nil {
		return fmt.Errorf("deploy: %w", err)
	}
	return nil
}

// RenderOverlay renders deploy/overlays/<overlay> with image (repository:tag or
// repository@digest) in place of the tree's ghcr.io/dirpv/dirpv:<release>, as a user's
// kustomization with an images: entry would: a release's single-file manifests.
func RenderOverlay(ctx context.Context, kustomizeBin, overlay, image string) ([]byte, error) {
	root, err := RepoDir()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "dirpv-overlay-")
	if err != nil {
		return nil, fmt.Errorf("deploy: %w", err)
	}
	defer os.RemoveAll(dir)
	rel, err := filepath.Rel(dir, filepath.Join(root, "deploy", "overlays", overlay))
	if err != nil {
		return nil, fmt.Errorf("deploy: %w", err)
	}
	images, err := imagesField(image)
	if err != nil {
		return nil, err
	}
	k := fmt.Sprintf("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\n%s", rel, images)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		return nil, fmt.Errorf("deploy: %w", err)
	}
	return Kustomize(ctx, kustomizeBin, dir)
}

// imagesField is the kustomization's images: entry that replaces ghcr.io/dirpv/dirpv with image.
func imagesField(image string) (string, error) {
	name, field, ref, err := splitImage(image)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("images:\n  - name: ghcr.io/dirpv/dirpv\n    newName: %s\n    %s: %q\n", name, field, ref), nil
}

// rebaseOnRendered copies the kustomization in dir to dst with its resource base (a directory
// such as ../kind) replaced by rendered, that directory's rendered output, and its other
// relative references pointing back at where they are: the same overlay, on top of a release's
// manifest instead of the tree, without the components named in without. It returns dst.
func rebaseOnRendered(dir, base string, rendered []byte, dst string, without ...string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		return "", fmt.Errorf("deploy: %w", err)
	}
	var k map[string]any
	if err := sigsyaml.Unmarshal(b, &k); err != nil {
		return "", fmt.Errorf("deploy: %s: %w", dir, err)
	}
	if res, _ := k["resources"].([]any); len(res) != 1 || res[0] != base {
		return "", fmt.Errorf("deploy: %s: resources %v, want only %s to replace", dir, k["resources"], base)
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return "", fmt.Errorf("deploy: %w", err)
	}
	k["resources"] = []any{"rendered.yaml"}
	if err := os.WriteFile(filepath.Join(dst, "rendered.yaml"), rendered, 0o644); err != nil {
		return "", fmt.Errorf("deploy: %w", err)
	}
	components, _ := k["components"].([]any)
	var kept []any
	for _, c := range components {
		if slices.Contains(without, fmt.Sprint(c)) {
			continue
		}
		rel, err := filepath.Rel(dst, filepath.Join(dir, fmt.Sprint(c)))
		if err != nil {
			return "", fmt.Errorf("deploy: %w", err)
		}
		kept = append(kept, rel)
	}
	if len(kept) < len(components)-len(without) {
		return "", fmt.Errorf("deploy: %s: components %v lack some of %v", dir, components, without)
	}
	if components != nil {
		k["components"] = kept
	}
	// Patches are files of the overlay, which kustomize loads only from beneath its own root.
	patches, _ := k["patches"].([]any)
	for _, p := range patches {
		m, _ := p.(map[string]any)
		file, ok := m["path"].(string)
		if !ok {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil {
			return "", fmt.Errorf("deploy: %w", err)
		}
		if err := os.WriteFile(filepath.Join(dst, file), data, 0o644); err != nil {
			return "", fmt.Errorf("deploy: %w", err)
		}
	}
	out, err := sigsyaml.Marshal(k)
	if err != nil {
		return "", fmt.Errorf("deploy: %w", err)
	}
	return dst, os.WriteFile(filepath.Join(dst, "kustomization.yaml"), out, 0o644)
}

// splitImage splits "repo:tag" or "repo@digest" (the registry may have a port) into the repo
// and the kustomize images field that pins it ("newTag" or "digest") with its value. An image
// with neither is refused: it would mean whatever "latest" is on the node.
func splitImage(image string) (name, field, ref string, err error) {
	repo, digest, hasDigest := strings.Cut(image, "@")
	tag := ""
	if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo, tag = repo[:i], repo[i+1:]
	}
	switch {
	case hasDigest:
		return repo, "digest", digest, nil // a tag next to a digest means nothing to the runtime
	case tag != "" && tag != "latest":
		return repo, "newTag", tag, nil
	}
	return "", "", "", fmt.Errorf("deploy: image %q: want a version tag or a digest, not latest or none", image)
}

// Decode splits multi-document YAML into objects, skipping empty documents (helm emits some).
func Decode(data []byte) ([]*unstructured.Unstructured, error) {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var objs []*unstructured.Unstructured
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("deploy: split YAML: %w", err)
		}
		var m map[string]any
		if err := utilyaml.Unmarshal(doc, &m); err != nil {
			return nil, fmt.Errorf("deploy: decode YAML document: %w\n%s", err, doc)
		}
		if len(m) == 0 {
			continue
		}
		objs = append(objs, &unstructured.Unstructured{Object: m})
	}
}

func run(ctx context.Context, bin string, args ...string) ([]byte, error) {
	return output(exec.CommandContext(ctx, bin, args...))
}

func output(cmd *exec.Cmd) ([]byte, error) {
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("%s %s: %w: %s", filepath.Base(cmd.Path), strings.Join(cmd.Args[1:], " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}
