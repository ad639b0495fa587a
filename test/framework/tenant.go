package framework

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	v1 "k8s.io/api/core/v1"
)

// TenantToolDir is where WithTenantTool mounts the tenant tool's directory in a pod: the tool
// is TenantToolDir + "/tenant".
const TenantToolDir = "/tools"

// BuildTenantTool builds test/internal/tenant static, so that it runs in a busybox pod, into
// dir (which must be readable by the pods' UIDs) as dir/tenant.
func BuildTenantTool(ctx context.Context, dir string) error {
	if err := os.Chmod(dir, 0o755); err != nil {
		return fmt.Errorf("tenant tool directory: %w", err)
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, "tenant"), "./test/internal/tenant")
	cmd.Dir = RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./test/internal/tenant: %w\n%s", err, out)
	}
	return nil
}

// WithTenantTool mounts dir, where BuildTenantTool put the tool, read-only at TenantToolDir in
// each of the pod's containers.
func WithTenantTool(pod *v1.Pod, dir string) *v1.Pod {
	dirType := v1.HostPathDirectory
	pod.Spec.Volumes = append(pod.Spec.Volumes, v1.Volume{Name: "tools", VolumeSource: v1.VolumeSource{
		HostPath: &v1.HostPathVolumeSource{Path: dir, Type: &dirType}}})
	for _, cs := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range cs {
			cs[i].VolumeMounts = append(cs[i].VolumeMounts, v1.VolumeMount{Name: "tools", MountPath: TenantToolDir, ReadOnly: true})
		}
	}
	return pod
}
