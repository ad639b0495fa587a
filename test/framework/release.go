package framework

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"

	"github.com/dirpv/dirpv/test/cluster"
	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/image"
)

// Release is an earlier commit of this repository as users run it: its image, and its deploy/
// to install it with.
type Release struct {
	// Commit is the full hash.
	Commit string
	// Image is ghcr.io/dirpv/dirpv:<short hash>, in the tar at ImageTar.
	Image    string
	ImageTar string
	// DeployRoot holds the commit's deploy/ (and nothing else), for deploy.E2ELocalOptions.Root.
	DeployRoot string
}

// releaseCacheDir is where release images are kept, next to the Kubernetes build cache:
// ${DIRPV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dirpv}/images.
func releaseCacheDir() (string, error) {
	if d := os.Getenv("DIRPV_CACHE"); d != "" {
		return filepath.Join(d, "images"), nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("release: cache dir: %w", err)
	}
	return filepath.Join(d, "dirpv", "images"), nil
}

// PrepareRelease returns the image and deploy/ of commit (an ancestor of this checkout) in
// workDir. The image is built as WriteDirpvTar builds this checkout's, from a detached git
// worktree of commit that is removed again, and cached by full commit hash: only the first
// run pays for the build.
func PrepareRelease(ctx context.Context, commit, workDir string, logf func(string, ...any)) (*Release, error) {
	root := RepoRoot()
	full, err := git(ctx, root, "rev-parse", "--verify", commit+"^{commit}")
	if err != nil {
		return nil, fmt.Errorf("release %s: not in this clone (a shallow clone lacks it: git fetch --unshallow): %w", commit, err)
	}
	r := &Release{Commit: full, Image: image.DirpvRepository + ":" + full[:7]}
	cache, err := releaseCacheDir()
	if err != nil {
		return nil, err
	}
	r.ImageTar = filepath.Join(cache, "dirpv-"+full+".tar")
	if _, err := os.Stat(r.ImageTar); errors.Is(err, os.ErrNotExist) {
		start := time.Now()
		if err := buildReleaseImage(ctx, root, r); err != nil {
			return nil, err
		}
		logf("built the image of %s in %s", full[:7], time.Since(start).Round(time.Millisecond))
	} else if err != nil {
		return nil, fmt.Errorf("release %s: %w", commit, err)
	}
	r.DeployRoot = filepath.Join(workDir, "release-"+full[:7])
	if err := os.MkdirAll(r.DeployRoot, 0o755); err != nil {
		return nil, fmt.Errorf("release %s: %w", commit, err)
	}
	// deploy/ alone, as `git archive` gives it: rendering needs nothing else of the commit.
	archive, err := git(ctx, root, "archive", "--format=tar", full, "deploy")
	if err != nil {
		return nil, err
	}
	tar := exec.CommandContext(ctx, "tar", "-x", "-C", r.DeployRoot)
	tar.Stdin = strings.NewReader(archive)
	if out, err := tar.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("release %s: extract deploy/: %w: %s", commit, err, out)
	}
	return r, nil
}

func buildReleaseImage(ctx context.Context, root string, r *Release) error {
	if err := os.MkdirAll(filepath.Dir(r.ImageTar), 0o755); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	wt, err := os.MkdirTemp("", "dirpv-release-")
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	defer os.RemoveAll(wt)
	if _, err := git(ctx, root, "worktree", "add", "--detach", wt, r.Commit); err != nil {
		return err
	}
	// A fresh context: the worktree goes even when ctx is done.
	defer git(context.Background(), root, "worktree", "remove", "--force", wt)
	partial := r.ImageTar + ".partial"
	defer os.Remove(partial)
	if _, _, err := image.WriteDirpvTar(ctx, image.DirpvOptions{
		ModuleDir: wt, Tag: r.Commit[:7], Version: r.Commit[:7], Output: partial,
	}); err != nil {
		return fmt.Errorf("release %s: %w", r.Commit[:7], err)
	}
	return os.Rename(partial, r.ImageTar)
}

func git(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	if args[0] == "archive" {
		return stdout.String(), nil
	}
	return strings.TrimSpace(stdout.String()), nil
}

// RenderInstall renders the e2e-local overlay with opts (its Root: another checkout's, for the
// upgrade test) for the cluster's apiserver, whose address and port it sets.
func RenderInstall(ctx context.Context, c *cluster.Cluster, opts deploy.E2ELocalOptions) ([]*unstructured.Unstructured, error) {
	kustomize, err := deploy.Tool(ctx, "kustomize", true)
	if err != nil {
		return nil, err
	}
	opts.APIServerPort, opts.APIServerHost = c.APIServerPort, c.APIServerHost
	manifests, err := deploy.RenderE2ELocal(ctx, kustomize, opts)
	if err != nil {
		return nil, err
	}
	return deploy.Decode(manifests)
}

// HelmPostRenderer writes into dir the helm post-renderer (deploy.E2ELocalPostRenderer) that
// adapts dirpv's chart to the cluster as RenderInstall adapts the kind overlay, and returns its
// path.
func HelmPostRenderer(ctx context.Context, c *cluster.Cluster, opts deploy.E2ELocalOptions, dir string) (string, error) {
	kustomize, err := deploy.Tool(ctx, "kustomize", true)
	if err != nil {
		return "", err
	}
	opts.APIServerPort, opts.APIServerHost = c.APIServerPort, c.APIServerHost
	return deploy.E2ELocalPostRenderer(kustomize, opts, dir)
}

// WaitRolledOut waits until every Deployment and DaemonSet in namespace has rolled out its
// current spec, as `kubectl rollout status` says, and every pod of theirs runs imageName and
// is ready: the pods of an earlier version are gone.
func WaitRolledOut(ctx context.Context, c kubernetes.Interface, namespace, imageName string, timeout time.Duration) error {
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		deps, err := c.AppsV1().Deployments(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, d := range deps.Items {
			if !deploymentDone(&d) {
				return false, fmt.Errorf("deployment %s: status %+v", d.Name, d.Status)
			}
		}
		dss, err := c.AppsV1().DaemonSets(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, d := range dss.Items {
			s := d.Status
			if s.ObservedGeneration < d.Generation || s.UpdatedNumberScheduled != s.DesiredNumberScheduled ||
				s.NumberAvailable != s.DesiredNumberScheduled || s.NumberUnavailable != 0 {
				return false, fmt.Errorf("daemonset %s: status %+v", d.Name, s)
			}
		}
		pods, err := c.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: labels.Set{"app.kubernetes.io/name": "dirpv"}.String()})
		if err != nil {
			return false, err
		}
		for _, p := range pods.Items {
			if p.Spec.Containers[0].Image != imageName || !podReady(&p) {
				return false, fmt.Errorf("pod %s: image %s, phase %s, deleting %v", p.Name, p.Spec.Containers[0].Image, p.Status.Phase, p.DeletionTimestamp != nil)
			}
		}
		return len(pods.Items) > 0, errors.New("no dirpv pod")
	})
	if err != nil {
		return fmt.Errorf("dirpv did not roll out %s: %w", imageName, err)
	}
	return nil
}

func deploymentDone(d *appsv1.Deployment) bool {
	s := d.Status
	want := int32(1)
	if d.Spec.Replicas != nil {
		want = *d.Spec.Replicas
	}
	return s.ObservedGeneration >= d.Generation && s.UpdatedReplicas == want && s.Replicas == want && s.AvailableReplicas == want
}

func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// OldRelease is what users ran before this version: the upgrade tests (test/e2e/install, and
// NFS in test/vm/node) install it, make volumes with it, and upgrade to this checkout
// (docs/operations.md, "Upgrading").
const OldRelease = "61921de"

// WriterScript writes a seed file, then appends a counter to /data/log until a write fails:
// the pod then ends (Failed) saying so, which an I/O error through a mount whose node plugin
// went away would cause. CheckWriting follows it.
const WriterScript = `echo seed > /data/seed; i=0; while echo $i >> /data/log; do i=$((i+1)); sleep 0.05; done; echo "write $i failed"; exit 1`

// CheckCounting waits up to timeout until WriterScript's log, as read returns it (from the
// node's disk, or from an NFS server's export), holds more than after lines, and returns their
// number. Lines other than the counter 0, 1, 2, ... (a gap, a repeat) fail it at once: the
// writer's file is not the one it wrote all along.
func CheckCounting(ctx context.Context, read func(context.Context) ([]byte, error), after int, timeout time.Duration) (int, error) {
	var n int
	var wrong error
	err := Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		b, err := read(ctx)
		if err != nil {
			return false, err
		}
		lines := strings.Split(string(b), "\n")
		lines = lines[:len(lines)-1] // a line being written, or "" after the last newline
		for i, l := range lines {
			if l != strconv.Itoa(i) {
				wrong = fmt.Errorf("the writer's log: line %d is %q: not the file it wrote all along", i, l)
				return true, nil
			}
		}
		n = len(lines)
		return n > after, fmt.Errorf("the writer's log has %d lines, want more than %d", n, after)
	})
	if wrong != nil {
		return n, wrong
	}
	return n, err
}

// CheckWriting checks that the WriterScript pod runs, never restarted, and still appends to
// the same file (read, as CheckCounting), and returns the log's lines, more than after.
func CheckWriting(ctx context.Context, c kubernetes.Interface, ns, pod string, read func(context.Context) ([]byte, error), after int, timeout time.Duration) (int, error) {
	// Past after, then past that: the writer writes on now, not only before it was looked at.
	n, err := CheckCounting(ctx, read, after, timeout)
	if err == nil {
		n, err = CheckCounting(ctx, read, n, timeout)
	}
	if err != nil {
		return n, fmt.Errorf("writer %s/%s: %w", ns, pod, err)
	}
	p, err := c.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
	if err != nil {
		return n, err
	}
	if p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].RestartCount != 0 {
		b, _ := c.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{}).DoRaw(ctx)
		return n, fmt.Errorf("writer %s/%s: phase %s, statuses %+v, log %q", ns, pod, p.Status.Phase, p.Status.ContainerStatuses, b)
	}
	return n, nil
}
