package provisioner

import (
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/dirpv/dirpv/volume"
)

// ConvertTarget says which provisioner's class ConvertClass translates, and where its volumes
// are: what that provisioner's deployment, not its class, says. Server and Share (its
// NFS_SERVER and NFS_PATH) for nfs-subdir-external-provisioner, BasePath (its nodePathMap) for
// local-path-provisioner. Both are often installed under provisioner names of their own, so
// the name does not tell.
type ConvertTarget struct {
	Server, Share string
	BasePath      string
}

// ConvertClass returns the StorageClass of driver (dirpv's) that replaces old under the same
// name, so that claims naming the class keep working and dirpv reclaims old's PVs as old's
// provisioner would have (see adopt.go). New volumes get directories named as the old
// provisioner named them, beside the old ones.
func ConvertClass(old *storagev1.StorageClass, to ConvertTarget, driver string) (*storagev1.StorageClass, error) {
	var params map[string]string
	var err error
	switch {
	case to.BasePath != "" && (to.Server != "" || to.Share != ""):
		err = fmt.Errorf("a local-path-provisioner class (base path) or an nfs-subdir-external-provisioner one (server and share), not both")
	case to.BasePath != "":
		params, err = localPathParams(old, to)
	default:
		params, err = nfsSubdirParams(old, to)
	}
	if err != nil {
		return nil, fmt.Errorf("StorageClass %s of %s: %w", old.Name, old.Provisioner, err)
	}
	if _, err := parseParameters(params); err != nil {
		return nil, fmt.Errorf("StorageClass %s of %s: the dirpv class would be refused: %w", old.Name, old.Provisioner, err)
	}
	// Only what a user set: the API server fills in the defaults again.
	meta := metav1.ObjectMeta{Name: old.Name, Labels: old.Labels}
	if v, ok := old.Annotations["storageclass.kubernetes.io/is-default-class"]; ok {
		meta.Annotations = map[string]string{"storageclass.kubernetes.io/is-default-class": v}
	}
	return &storagev1.StorageClass{
		TypeMeta:             metav1.TypeMeta{APIVersion: "storage.k8s.io/v1", Kind: "StorageClass"},
		ObjectMeta:           meta,
		Provisioner:          driver,
		Parameters:           params,
		ReclaimPolicy:        old.ReclaimPolicy,
		MountOptions:         old.MountOptions,
		AllowVolumeExpansion: old.AllowVolumeExpansion,
		VolumeBindingMode:    old.VolumeBindingMode,
	}, nil
}

// ConvertClassManifest reads a StorageClass (YAML or JSON, as `kubectl get -o yaml` prints
// it) from in and writes ConvertClass's class to out as YAML, for `kubectl replace --force`.
func ConvertClassManifest(in io.Reader, out io.Writer, to ConvertTarget, driver string) error {
	b, err := io.ReadAll(io.LimitReader(in, 1<<20))
	if err != nil {
		return fmt.Errorf("read the StorageClass: %w", err)
	}
	var old storagev1.StorageClass
	if err := yaml.UnmarshalStrict(b, &old); err != nil {
		return fmt.Errorf("read the StorageClass: %w", err)
	}
	if old.Kind != "StorageClass" {
		return fmt.Errorf("read a %s %q, want one StorageClass", volume.Quote(old.Kind), old.Name)
	}
	class, err := ConvertClass(&old, to, driver)
	if err != nil {
		return err
	}
	b, err = yaml.Marshal(class)
	if err != nil {
		return fmt.Errorf("write the StorageClass: %w", err)
	}
	_, err = out.Write(b)
	return err
}

// nfsSubdirRef is a variable of nfs-subdir-external-provisioner's pathPattern.
var nfsSubdirRef = regexp.MustCompile(`\$\{\.PVC\.(namespace|name|labels\.([^}]+)|annotations\.([^}]+))\}`)

func nfsSubdirParams(old *storagev1.StorageClass, to ConvertTarget) (map[string]string, error) {
	if to.Server == "" || to.Share == "" {
		return nil, fmt.Errorf("nfs-subdir-external-provisioner's server and path (its NFS_SERVER and NFS_PATH), or local-path-provisioner's base path, are needed")
	}
	if err := onlyParams(old, "archiveOnDelete", "onDelete", "pathPattern"); err != nil {
		return nil, err
	}
	p := map[string]string{ParamBackend: string(volume.BackendNFS), ParamServer: to.Server, ParamShare: to.Share,
		ParamPathPattern: DefaultPathPattern, ParamOnDelete: string(OnDeleteArchive)}
	// Its order: onDelete first, then archiveOnDelete (default true).
	switch s := old.Parameters["onDelete"]; s {
	case "delete", "retain":
		p[ParamOnDelete] = s
	case "":
		if s, ok := old.Parameters["archiveOnDelete"]; ok {
			archive, err := strconv.ParseBool(s)
			if err != nil {
				return nil, fmt.Errorf("archiveOnDelete %s: want true or false", volume.Quote(s))
			}
			if !archive {
				p[ParamOnDelete] = string(OnDeleteDelete)
			}
		}
	default:
		return nil, fmt.Errorf("onDelete %s: want delete or retain", volume.Quote(s))
	}
	if s, ok := old.Parameters["pathPattern"]; ok {
		pat := nfsSubdirRef.ReplaceAllStringFunc(s, func(ref string) string {
			m := nfsSubdirRef.FindStringSubmatch(ref)
			switch {
			case m[1] == "namespace":
				return "${pvc.metadata.namespace}"
			case m[1] == "name":
				return "${pvc.metadata.name}"
			case m[2] != "":
				return "${pvc.metadata.labels['" + m[2] + "']}"
			}
			return "${pvc.metadata.annotations['" + m[3] + "']}"
		})
		if strings.Contains(strings.ReplaceAll(pat, "${pvc.", ""), "${") {
			return nil, fmt.Errorf("pathPattern %s names a variable other than ${.PVC.namespace}, ${.PVC.name}, ${.PVC.labels.KEY} and ${.PVC.annotations.KEY}", volume.Quote(s))
		}
		p[ParamPathPattern] = strings.Trim(pat, "/")
	}
	return p, nil
}

func localPathParams(old *storagev1.StorageClass, to ConvertTarget) (map[string]string, error) {
	if to.BasePath == "" {
		return nil, fmt.Errorf("local-path-provisioner's node path (its nodePathMap) is needed")
	}
	// Its directories are made on the node the pod is scheduled to.
	if old.VolumeBindingMode == nil || *old.VolumeBindingMode != storagev1.VolumeBindingWaitForFirstConsumer {
		return nil, fmt.Errorf("volumeBindingMode must be WaitForFirstConsumer for local volumes")
	}
	if err := onlyParams(old); err != nil {
		return nil, err
	}
	policy := OnDeleteDelete
	if old.ReclaimPolicy != nil && *old.ReclaimPolicy == v1.PersistentVolumeReclaimRetain {
		policy = OnDeleteRetain
	}
	return map[string]string{ParamBackend: string(volume.BackendLocal), ParamBasePath: to.BasePath,
		ParamPathPattern: "${pv.metadata.name}_${pvc.metadata.namespace}_${pvc.metadata.name}", ParamOnDelete: string(policy)}, nil
}

// onlyParams refuses parameters other than known: a setting ConvertClass would drop.
func onlyParams(old *storagev1.StorageClass, known ...string) error {
	var unknown []string
	for k := range old.Parameters {
		if !slices.Contains(known, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return fmt.Errorf("parameters %s have no dirpv equivalent", volume.QuoteList(unknown))
	}
	return nil
}
