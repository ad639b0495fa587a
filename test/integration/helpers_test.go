package integration

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

const timeout = 60 * time.Second

// className derives an object name from the test's name: a class of the test's own.
func className(t *testing.T) string {
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	return strings.Trim(name[max(len(name)-60, 0):], "-")
}

// flagOf returns the value p was started with for flag (--flag value, or --flag=value).
func flagOf(t *testing.T, p *framework.Process, flag string) string {
	t.Helper()
	for i, a := range p.Args {
		if a == flag && i+1 < len(p.Args) {
			return p.Args[i+1]
		}
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
	}
	t.Fatalf("%s was started without %s: %q", p.Name, flag, p.Args)
	return ""
}

// localClass creates a local StorageClass with its own base directory and returns both.
func localClass(t *testing.T, params map[string]string, opts ...framework.ClassOption) (*storagev1.StorageClass, string) {
	t.Helper()
	name := className(t)
	base := filepath.Join(suite.Work.BaseRoot, name)
	p := map[string]string{"backend": "local", "basePath": base}
	for k, v := range params {
		p[k] = v
	}
	return suite.CreateClass(t, name, p, opts...), base
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
	_, err := suite.Client.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{})
	must(t, err)
}

// must fails the test if err is not nil, with the log tails of procs: what the dirpv
// processes said about it.
func must(t *testing.T, err error, procs ...*framework.Process) {
	t.Helper()
	if err == nil {
		return
	}
	msg := err.Error()
	for _, p := range procs {
		msg += fmt.Sprintf("\n--- %s log tail:\n%s", p.Name, p.Tail(3000))
	}
	t.Fatal(msg)
}

// waitEvent waits for an event of reason mentioning substr on the object (ns "" for a PV) and
// returns it; if none comes, the test fails with the procs' log tails.
func waitEvent(t *testing.T, ns, kind, name, reason, substr string, procs ...*framework.Process) *v1.Event {
	t.Helper()
	ev, err := framework.WaitForEvent(context.Background(), suite.Client, ns, kind, name, reason, substr, timeout)
	must(t, err, procs...)
	return ev
}

// waitBound waits for the claim to bind and returns it and its PV.
func waitBound(t *testing.T, ns, name string) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
	t.Helper()
	ctx := context.Background()
	pvc, err := framework.WaitForPVCBound(ctx, suite.Client, ns, name, timeout)
	must(t, err, nodeProc, ctrlProc)
	pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	must(t, err)
	return pvc, pv
}

func deleteClaim(t *testing.T, ns, name string) {
	t.Helper()
	must(t, suite.Client.CoreV1().PersistentVolumeClaims(ns).Delete(context.Background(), name, metav1.DeleteOptions{}))
}

// waitPVGone waits until the PV object is deleted, i.e. the provisioner finished Delete.
func waitPVGone(t *testing.T, name string) {
	t.Helper()
	must(t, framework.WaitForPVDeleted(context.Background(), suite.Client, name, timeout))
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
