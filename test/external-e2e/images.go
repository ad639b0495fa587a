package externale2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/dirpv/dirpv/test/image"
)

// ImageStore is the containerd of the node the suite's pods run on.
type ImageStore interface {
	ImportImage(ctx context.Context, tarPath string) error
	TagImage(ctx context.Context, src, dst string) error
}

// RepoListYAML is the KUBE_TEST_REPO_LIST file's content: it maps every registry of
// k8s.io/kubernetes/test/utils/image to a name under dirpv.local, which no one serves: the
// images the suite runs are built here and imported.
const RepoListYAML = `promoterE2eRegistry: dirpv.local/e2e-test-images
buildImageRegistry: dirpv.local/build-image
invalidRegistry: invalid.registry.k8s.io/invalid
gcEtcdRegistry: dirpv.local
gcRegistry: dirpv.local
sigStorageRegistry: dirpv.local/sig-storage
privateRegistry: dirpv.local/private
dockerLibraryRegistry: dirpv.local/library
cloudProviderGcpRegistry: dirpv.local/cloud-provider-gcp
`

// busyboxStandsIn reports whether the cluster's busybox image serves as repo: busybox itself,
// also under the name some tests give it without the repo list (registry.k8s.io), and images
// that the storage tests run only for a shell and core utilities: glibc-dns-testing
// (multiVolume: dd, sha256sum, mkdir) and nginx (volumes' exec test: echo, chmod, a script).
func busyboxStandsIn(repo string) bool {
	switch repo {
	case "dirpv.local/e2e-test-images/busybox", "registry.k8s.io/e2e-test-images/busybox",
		"dirpv.local/e2e-test-images/glibc-dns-testing", "dirpv.local/e2e-test-images/nginx":
		return true
	}
	return false
}

// ProvideImages puts into the node's containerd, under the names e2e.test asks for (its
// -list-images, read with the repo list applied, so versions are e2e.test's own), the images
// the storage tests run: agnhost (built from k8s.io/kubernetes/test/images/agnhost, on a
// busybox userland as upstream's has a shell), busybox and pause (the cluster's own, tagged;
// busybox also under the names of busyboxStandsIn).
// Any other image stays missing and its test fails with the image's name in the pod's events.
func ProvideImages(ctx context.Context, node ImageStore, busybox, pause, workDir, e2eTest, agnhost, repoList string) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, e2eTest, "-list-images")
	cmd.Env = append(os.Environ(), "KUBE_TEST_REPO_LIST="+repoList)
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("e2e.test -list-images: %w", err)
	}
	var agnhostNames []string
	for _, name := range strings.Fields(string(out)) {
		repo, _, _ := strings.Cut(name, ":")
		switch {
		case repo == "dirpv.local/e2e-test-images/agnhost":
			agnhostNames = append(agnhostNames, name)
		case busyboxStandsIn(repo):
			err = node.TagImage(ctx, busybox, name)
		case repo == "dirpv.local/pause":
			err = node.TagImage(ctx, pause, name)
		}
		if err != nil {
			return err
		}
	}
	if len(agnhostNames) == 0 {
		return fmt.Errorf("e2e.test -list-images names no agnhost image under the repo list's registry:\n%s", out)
	}
	dir := filepath.Join(workDir, "images")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	files, err := image.BusyboxFiles(ctx, dir)
	if err != nil {
		return err
	}
	files = append(files,
		image.File{HostPath: agnhost, ImagePath: "/agnhost", Mode: 0o755},
		// Upstream's image has it too: entrypoint tests run the same binary by another name.
		image.File{ImagePath: "/agnhost-2", Symlink: "agnhost"})
	tar := filepath.Join(dir, "agnhost.tar")
	if err := image.WriteOCITar(tar, agnhostNames[0], files, image.Config{Entrypoint: []string{"/agnhost"}, Cmd: []string{"pause"}}); err != nil {
		return fmt.Errorf("agnhost image: %w", err)
	}
	if err := node.ImportImage(ctx, tar); err != nil {
		return err
	}
	// The previous agnhost version the suite names is served by this one.
	for _, name := range agnhostNames[1:] {
		if err := node.TagImage(ctx, agnhostNames[0], name); err != nil {
			return err
		}
	}
	return nil
}
