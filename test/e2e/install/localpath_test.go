package install

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/dirpv/dirpv/provisioner"
	"github.com/dirpv/dirpv/test/deploy"
	"github.com/dirpv/dirpv/test/framework"
)

// localPathBase is local-path-provisioner's node path here: beneath dirpv's allowed base, as
// docs/migrating.md has users allow local-path's own.
const localPathBase = basePath + "/install-local-path"

// localPathConfig is what local-path-provisioner's deploy/local-path-storage.yaml (v0.0.30)
// puts in its ConfigMap, with its node path and the helper pod's image made local (its
// --helper-image does not apply to a helper pod file), and without
// the helper pod's priority class system-node-critical, which only kube-system may use here.
func localPathConfig(ns, image string) *v1.ConfigMap {
	return &v1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "local-path-config", Namespace: ns}, Data: map[string]string{
		"config.json": `{"nodePathMap":[{"node":"DEFAULT_PATH_FOR_NON_LISTED_NODES","paths":["` + localPathBase + `"]}]}`,
		"setup":       "#!/bin/sh\nset -eu\nmkdir -m 0777 -p \"$VOL_DIR\"",
		"teardown":    "#!/bin/sh\nset -eu\nrm -rf \"$VOL_DIR\"",
		"helperPod.yaml": `apiVersion: v1
kind: Pod
metadata:
  name: helper-pod
spec:
  containers:
  - name: helper-pod
    image: ` + image + `
    imagePullPolicy: Never`,
	}}
}

// startLocalPath runs local-path-provisioner v0.0.30 itself (built from the Go module proxy by
// test/deploy/tools.sh) as kind runs it, with its objects in namespace ns, and returns what
// stops it.
func startLocalPath(t *testing.T, ns string) (stop func()) {
	t.Helper()
	ctx := context.Background()
	bin, err := deploy.Tool(ctx, "local-path-provisioner", true)
	must(t, err)
	cm := localPathConfig(ns, suite.Cluster.BusyboxImage)
	_, err = suite.Client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{})
	must(t, err)
	_, err = suite.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "local-path-provisioner-service-account"}}, metav1.CreateOptions{})
	must(t, err)
	dir := t.TempDir()
	for name, data := range map[string]string{"config.json": cm.Data["config.json"], "helperPod.yaml": cm.Data["helperPod.yaml"]} {
		must(t, os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644))
	}
	log, err := os.Create(filepath.Join(suite.Work.LogDir, "local-path-provisioner.log"))
	must(t, err)
	cmd := exec.Command(bin, "--debug", "start", "--kubeconfig", suite.Cluster.Kubeconfig, "--namespace", ns,
		"--config", filepath.Join(dir, "config.json"), "--helper-pod-file", filepath.Join(dir, "helperPod.yaml"),
		"--helper-image", suite.Cluster.BusyboxImage, "--provisioner-name", "rancher.io/local-path")
	cmd.Stdout, cmd.Stderr = log, log
	must(t, cmd.Start())
	var stopped bool
	stop = func() {
		if !stopped {
			stopped = true
			cmd.Process.Kill()
			cmd.Wait()
			log.Close()
		}
	}
	t.Cleanup(stop)
	return stop
}

// adopt turns on --adopt-provisioners=name in the installed controller and node plugin, as
// `helm upgrade --set adoptProvisioners={name}` does, and waits for both to run with it.
func adopt(t *testing.T, name string) {
	t.Helper()
	ctx := context.Background()
	patch, err := json.Marshal([]map[string]string{{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--adopt-provisioners=" + name}})
	must(t, err)
	apps := suite.Client.AppsV1()
	_, err = apps.Deployments("dirpv").Patch(ctx, "dirpv-controller", types.JSONPatchType, patch, metav1.PatchOptions{})
	must(t, err)
	_, err = apps.DaemonSets("dirpv").Patch(ctx, "dirpv-node", types.JSONPatchType, patch, metav1.PatchOptions{})
	must(t, err)
	ds, err := apps.DaemonSets("dirpv").Get(ctx, "dirpv-node", metav1.GetOptions{})
	must(t, err)
	if err := framework.WaitRolledOut(ctx, suite.Client, "dirpv", ds.Spec.Template.Spec.Containers[0].Image, 3*time.Minute); err != nil {
		t.Fatalf("rollout with --adopt-provisioners: %v", err)
	}
}

// Moving from a running local-path-provisioner (kind's) as docs/migrating.md says, with a pod
// writing to one of its volumes throughout: local-path itself provisions the claim; it is
// stopped, its class replaced by `dirpv convert-class`'s under the same name, and adoption
// turned on. The pod's mount is kubelet's hostPath and never stops (it keeps writing through
// dirpv's restart); a new claim of the class name gets a dirpv volume in the same base; once
// the old claim and its pod are deleted, dirpv removes local-path's directory (the class's
// reclaim Delete) and the PV goes.
func TestTakeOverFromRunningLocalPath(t *testing.T) {
	ctx := context.Background()
	ns := suite.NewNamespace(t)
	const class = "install-standard"
	suite.CreateClass(t, class, nil, framework.Provisioner("rancher.io/local-path"))
	stopLocalPath := startLocalPath(t, ns)

	suite.CreateClaim(t, ns, "old", class)
	suite.CreatePod(t, suite.BusyboxPod(ns, "writer", "old", `i=0; while :; do i=$((i+1)); echo $i >> /data/log; sleep 0.2; done`, false))
	if _, err := framework.WaitForPodPhase(ctx, suite.Client, ns, "writer", v1.PodRunning, timeout); err != nil {
		var pods []string
		if list, err := suite.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); err == nil {
			for _, p := range list.Items {
				pods = append(pods, fmt.Sprintf("%s %s%s", p.Name, p.Status.Phase, framework.EventsOf(ctx, suite.Client, ns, "Pod", p.Name)))
			}
		}
		t.Fatalf("%v\nclaim:%s\npods: %s", err, framework.EventsOf(ctx, suite.Client, ns, "PersistentVolumeClaim", "old"), strings.Join(pods, "\n  "))
	}
	pv, err := framework.WaitForBoundPV(ctx, suite.Client, ns, "old", timeout)
	must(t, err)
	if pv.Annotations[provisioner.AnnProvisionedBy] != "rancher.io/local-path" || pv.Spec.HostPath == nil {
		t.Fatalf("claim old got PV %s provisioned by %q, source %+v; want local-path's hostPath", pv.Name, pv.Annotations[provisioner.AnnProvisionedBy], pv.Spec.PersistentVolumeSource)
	}
	dir := pv.Spec.HostPath.Path
	if want := filepath.Join(localPathBase, pv.Name+"_"+ns+"_old"); dir != want {
		t.Fatalf("local-path's directory %s, want %s", dir, want)
	}
	size := readGrows(t, filepath.Join(dir, "log"), 0)

	stopLocalPath()
	dirpv, err := framework.BuildDirpv(ctx, suite.Work.Dir)
	must(t, err)
	_, err = framework.ReplaceClass(ctx, suite.Client, dirpv, class, "--base-path="+localPathBase)
	must(t, err)
	adopt(t, "rancher.io/local-path")
	size = readGrows(t, filepath.Join(dir, "log"), size)

	suite.CreateClaim(t, ns, "new", class)
	suite.CreatePod(t, suite.BusyboxPod(ns, "reader", "new", `echo new > /data/new; cat /data/new`, false))
	if out := podDone(t, ns, "reader"); !strings.Contains(out, "new") {
		t.Errorf("a pod on a new claim of class %s printed %q", class, out)
	}
	npv, err := framework.WaitForBoundPV(ctx, suite.Client, ns, "new", timeout)
	must(t, err)
	if npv.Spec.CSI == nil || npv.Spec.CSI.Driver != "dirpv.io" {
		t.Fatalf("the new claim of class %s got %+v, want a dirpv.io volume", class, npv.Spec.PersistentVolumeSource)
	}
	if b, err := os.ReadFile(filepath.Join(localPathBase, npv.Name+"_"+ns+"_new", "new")); err != nil || string(b) != "new\n" {
		t.Errorf("the new claim's file in local-path's base: %q, %v", b, err)
	}
	got, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
	must(t, err)
	if got.Annotations[provisioner.AnnNode] != suite.Cluster.NodeName || !slices.Contains(got.Finalizers, "external-provisioner.volume.kubernetes.io/finalizer") {
		t.Errorf("adopted PV: annotations %v, finalizers %v; want it handed to node %s, with the lib's finalizer", got.Annotations, got.Finalizers, suite.Cluster.NodeName)
	}

	deletePodAndClaim(t, ns, "writer", "old")
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("local-path's directory %s after its claim's delete (reclaim Delete): %v, want it gone", dir, err)
	}
	t.Logf("the writer wrote %d bytes through local-path's stop, the class's replacement and dirpv's restart", size)
}
