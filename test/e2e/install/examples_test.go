package install

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/volume/quota"
)

// exampleChecks says, for each local-volume file of examples/, what it promises once applied
// as written: claims Bound, pods running, data where the file's comments say. A new example
// without an entry fails TestExamplesRunAsWritten.
var exampleChecks = map[string]func(t *testing.T, ns string){
	"local-default-class.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "local-writer")
		dir := volumeDir(t, ns, "local-data")
		waitFileHas(t, filepath.Join(dir, "hello.txt"), "hello from local-writer")
		c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), "local-data", metav1.GetOptions{})
		must(t, err)
		if class := ptr.Deref(c.Spec.StorageClassName, ""); class != "dirpv-local" {
			t.Errorf("claim local-data is of class %q, want the default class dirpv-local", class)
		}
	},
	"archive-class.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "archive-writer")
		dir := volumeDir(t, ns, "reports")
		waitFileHas(t, filepath.Join(dir, "today.txt"), "report ")
		archives := filepath.Join(filepath.Dir(dir), "archived-"+filepath.Base(dir)+"-*")
		deletePodAndClaim(t, ns, "archive-writer", "reports")
		got, _ := filepath.Glob(archives)
		if len(got) != 1 {
			t.Fatalf("archives %s after deleting the claim: %v, want one", archives, got)
		}
		waitFileHas(t, filepath.Join(got[0], "today.txt"), "report ")
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("volume directory %s is still there beside its archive: %v", dir, err)
		}
	},
	"retain-class.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "keep-me-writer")
		dir := volumeDir(t, ns, "keep-me")
		created := filepath.Join(dir, "created")
		waitFileHas(t, created, ":") // date's time of day
		deletePodAndClaim(t, ns, "keep-me-writer", "keep-me")
		if b, err := os.ReadFile(created); err != nil || len(b) == 0 {
			t.Errorf("after the claim and its PV are gone, %s: %q, %v; want the pod's date still there", created, b, err)
		}
	},
	"path-pattern-labels.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "warehouse-writer")
		dir := volumeDir(t, ns, "warehouse")
		team := filepath.Join(basePath, "analytics")
		if filepath.Dir(dir) != team || !strings.HasPrefix(filepath.Base(dir), ns+"-warehouse-") {
			t.Errorf("volume directory %s, want %s/%s-warehouse-<pv>", dir, team, ns)
		}
		waitFileHas(t, filepath.Join(dir, "ready"), "")
		deletePodAndClaim(t, ns, "warehouse-writer", "warehouse")
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("volume directory %s is still there after its claim was deleted: %v", dir, err)
		}
		// The team directory holds other claims' volumes, if any: removed only when empty.
		os.Remove(team)
	},
	"owner-mode-class.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "app-as-1000")
		dir := volumeDir(t, ns, "app-data")
		waitFileHas(t, filepath.Join(dir, "written-as-1000"), "")
		fi, err := os.Stat(dir)
		must(t, err)
		st := fi.Sys().(*syscall.Stat_t)
		if st.Uid != 1000 || st.Gid != 1000 || fi.Mode()&(os.ModePerm|os.ModeSetgid) != os.ModeSetgid|0o770 {
			t.Errorf("volume directory %s: uid %d gid %d mode %v, want 1000 1000 and rwxrwx--- with setgid", dir, st.Uid, st.Gid, fi.Mode())
		}
	},
	"capacity-required-class.yaml": func(t *testing.T, ns string) {
		// What the example promises depends on the file system under the node's base.
		base, err := os.Open(basePath)
		must(t, err)
		defer base.Close()
		fs, err := quota.Probe(int(base.Fd()))
		must(t, err)
		if why := fs.Enforces(); why != nil {
			t.Logf("%s cannot enforce sizes (%v): the pod must stay unscheduled", basePath, why)
			ctx := context.Background()
			_, err := framework.WaitForEvent(ctx, suite.Client, ns, "Pod", "sized-writer", "FailedScheduling", "did not have enough free storage", timeout)
			must(t, err)
			if c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "sized", metav1.GetOptions{}); err != nil || c.Status.Phase == v1.ClaimBound {
				t.Errorf("claim sized on a base that cannot enforce its size: %v, %v; want it not Bound", c.Status.Phase, err)
			}
			return
		}
		examplePodRunning(t, ns, "sized-writer")
		pv, err := framework.WaitForBoundPV(context.Background(), suite.Client, ns, "sized", timeout)
		must(t, err)
		if q := pv.Spec.CSI.VolumeAttributes["quota"]; q == "" {
			t.Errorf("PV %s of a required-capacity claim records no quota: %v", pv.Name, pv.Spec.CSI.VolumeAttributes)
		}
	},
	"clone.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "seed-writer")
		examplePodRunning(t, ns, "clone-reader")
		waitLogContains(t, ns, "clone-reader", "seeded on seed-writer")
		waitFileHas(t, filepath.Join(volumeDir(t, ns, "seeded-clone"), "seed.txt"), "seeded on seed-writer")
	},
	"snapshot-restore.yaml": func(t *testing.T, ns string) {
		examplePodRunning(t, ns, "writer")
		written := filepath.Join(volumeDir(t, ns, "source"), "written-at")
		waitFileHas(t, written, ":") // date's time of day
		waitSnapshotReady(t, ns, "source-snap")
		examplePodRunning(t, ns, "reader")
		want, err := os.ReadFile(written)
		must(t, err)
		if logs := waitLogContains(t, ns, "reader", ""); logs != string(want) {
			t.Errorf("reader printed %q, want what writer wrote: %q", logs, want)
		}
	},
}

// Every example under examples/ that uses local volumes is applied exactly as written, each in
// a namespace of its own (none names one), on the cluster `make up` makes (dirpv installed
// from deploy/overlays/e2e-local, snapshots included), and does what its comments promise.
// Examples of an NFS class need a kernel NFS client on the node and an export: they belong to
// the VM node tier and are skipped here, saying so.
func TestExamplesRunAsWritten(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(framework.RepoRoot(), "examples", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("examples: %v %v", files, err)
	}
	for _, file := range files {
		name := filepath.Base(file)
		t.Run(name, func(t *testing.T) {
			data, err := os.ReadFile(file)
			must(t, err)
			objs, err := deploy.Decode(data)
			must(t, err)
			for _, o := range objs {
				if backend, _, _ := unstructured.NestedString(o.Object, "parameters", "backend"); o.GetKind() == "StorageClass" && backend == "nfs" {
					t.Skipf("class %s is NFS: needs a kernel NFS client on the node and an export (test/vm node tier)", o.GetName())
				}
				if o.GetNamespace() != "" {
					t.Fatalf("%s %s names namespace %s: give it its own namespace here", o.GetKind(), o.GetName(), o.GetNamespace())
				}
			}
			check := exampleChecks[name]
			if check == nil {
				t.Fatalf("no check for examples/%s: say in exampleChecks what it promises", name)
			}
			t.Parallel()
			ns := suite.NewNamespace(t)
			ctx := context.Background()
			// As the example's comments say: the step=source objects first (kubectl apply -l
			// step=source), their pods Ready (kubectl wait), then the whole file.
			var source []*unstructured.Unstructured
			for _, o := range objs {
				if o.GetLabels()["step"] == "source" {
					source = append(source, o.DeepCopy())
				}
			}
			if len(source) > 0 {
				_, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, source, ns)
				must(t, err)
				for _, o := range source {
					if o.GetKind() == "Pod" {
						examplePodReady(t, ns, o.GetName())
					}
				}
			}
			inst, err := framework.ApplyObjects(ctx, suite.Cluster.Kubeconfig, objs, ns)
			must(t, err)
			t.Cleanup(func() {
				// Pods first, without the 30 s grace a sleeping shell ignores, then the claims,
				// whose volumes must be gone before their class is.
				pods, _ := suite.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
				for _, p := range pods.Items {
					suite.Client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
				}
				claims, _ := suite.Client.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
				for _, c := range claims.Items {
					deletePodAndClaim(t, ns, "", c.Name)
				}
				if err := inst.Uninstall(ctx); err != nil {
					t.Errorf("delete examples/%s: %v", name, err)
				}
				// What onDelete retain and archive keep of the namespace's volumes, also
				// when a check failed before deleting its claim itself.
				removeGlob(filepath.Join(basePath, ns+"-*"))
				removeGlob(filepath.Join(basePath, "archived-"+ns+"-*"))
			})
			check(t, ns)
		})
	}
}

// examplePodRunning waits for an example's pod to run, and gives up at once on a pod that
// cannot: an image the node cannot pull, a container that keeps failing.
func examplePodRunning(t *testing.T, ns, name string) {
	t.Helper()
	waitExamplePod(t, ns, name, func(pod *v1.Pod) bool { return pod.Status.Phase == v1.PodRunning })
}

// examplePodReady is examplePodRunning until the pod is Ready, as `kubectl wait
// --for=condition=Ready` waits.
func examplePodReady(t *testing.T, ns, name string) {
	t.Helper()
	waitExamplePod(t, ns, name, func(pod *v1.Pod) bool {
		for _, c := range pod.Status.Conditions {
			if c.Type == v1.PodReady {
				return c.Status == v1.ConditionTrue
			}
		}
		return false
	})
}

func waitExamplePod(t *testing.T, ns, name string, done func(*v1.Pod) bool) {
	t.Helper()
	ctx := context.Background()
	var stuck string
	err := framework.Poll(ctx, timeout, func(ctx context.Context) (bool, error) {
		pod, err := suite.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, cs := range pod.Status.ContainerStatuses {
			if w := cs.State.Waiting; w != nil {
				switch w.Reason {
				case "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "CrashLoopBackOff":
					stuck = fmt.Sprintf("container %s: %s: %s", cs.Name, w.Reason, w.Message)
					return true, nil
				}
			}
		}
		return done(pod), fmt.Errorf("pod is %s: %+v %+v", pod.Status.Phase, pod.Status.Conditions, pod.Status.ContainerStatuses)
	})
	if err == nil && stuck != "" {
		err = fmt.Errorf("%s", stuck)
	}
	if err != nil {
		t.Fatalf("pod %s/%s does not run: %v\nevents:%s", ns, name, err, framework.EventsOf(ctx, suite.Client, ns, "Pod", name))
	}
}

// waitFileHas waits until the file exists and holds substr; "" asks only that it exists, as
// after a touch.
func waitFileHas(t *testing.T, path, substr string) {
	t.Helper()
	err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
		b, err := os.ReadFile(path)
		return err == nil && strings.Contains(string(b), substr), fmt.Errorf("%q, %v", b, err)
	})
	if err != nil {
		t.Fatalf("%s does not hold %q: %v", path, substr, err)
	}
}

// deletePod deletes the pod, if it is there, and waits until it is gone.
func deletePod(t *testing.T, ns, pod string) {
	t.Helper()
	ctx := context.Background()
	if err := suite.Client.CoreV1().Pods(ns).Delete(ctx, pod, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	must(t, framework.WaitForPodDeleted(ctx, suite.Client, ns, pod, timeout))
}

// deletePodAndClaim deletes the pod (if pod is not "") and then the claim, as the examples'
// comments tell users to, and waits until the claim's PV is gone: dirpv has then done what
// the class's onDelete says to the directory.
func deletePodAndClaim(t *testing.T, ns, pod, claim string) {
	t.Helper()
	ctx := context.Background()
	c := suite.Client.CoreV1()
	if pod != "" {
		deletePod(t, ns, pod)
	}
	pvc, err := c.PersistentVolumeClaims(ns).Get(ctx, claim, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return
	}
	must(t, err)
	if err := c.PersistentVolumeClaims(ns).Delete(ctx, claim, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if pvc.Spec.VolumeName == "" {
		return
	}
	must(t, framework.WaitForPVDeleted(ctx, suite.Client, pvc.Spec.VolumeName, timeout))
}

func waitSnapshotReady(t *testing.T, ns, name string) {
	t.Helper()
	snaps := snapClient(t)
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		s, err := snaps.SnapshotV1().VolumeSnapshots(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return s.Status != nil && ptr.Deref(s.Status.ReadyToUse, false), fmt.Errorf("status %+v", s.Status)
	})
	if err != nil {
		t.Fatalf("VolumeSnapshot %s/%s is not ready to use: %v\nevents:%s", ns, name, err,
			framework.EventsOf(context.Background(), suite.Client, ns, "VolumeSnapshot", name))
	}
}

func removeGlob(pattern string) {
	dirs, _ := filepath.Glob(pattern)
	for _, d := range dirs {
		os.RemoveAll(d)
	}
}
