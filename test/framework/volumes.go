package framework

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// CheckOnePVPerClaim checks what was provisioned for the claims in ns against what is on disk:
// each claim has exactly one PV, counted by the claim's UID (spec.claimRef.uid), so that a
// second PV under another name is seen; no two PVs share a directory; every name in dirs (the
// entries of the base or export that belong to ns) is the path of one of those PVs, so an
// orphan directory is seen; and every PV's path is in dirs (so PV paths must be single
// components, as with the default pathPattern). It returns one line per violation.
func CheckOnePVPerClaim(ctx context.Context, c kubernetes.Interface, ns string, dirs []string) ([]string, error) {
	claims, err := c.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list claims of %s: %w", ns, err)
	}
	pvs, err := c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list PVs: %w", err)
	}
	perClaim := map[types.UID][]string{}
	byPath := map[string]string{}
	var problems []string
	for _, pv := range pvs.Items {
		ref := pv.Spec.ClaimRef
		if ref == nil || ref.Namespace != ns {
			continue
		}
		perClaim[ref.UID] = append(perClaim[ref.UID], pv.Name)
		if pv.Spec.CSI == nil {
			problems = append(problems, fmt.Sprintf("PV %s of claim %s is not a CSI volume", pv.Name, ref.Name))
			continue
		}
		p := pv.Spec.CSI.VolumeAttributes["path"]
		if other, dup := byPath[p]; dup {
			problems = append(problems, fmt.Sprintf("PVs %s and %s share directory %s", other, pv.Name, p))
		}
		byPath[p] = pv.Name
	}
	for _, cl := range claims.Items {
		if got := perClaim[cl.UID]; len(got) != 1 {
			problems = append(problems, fmt.Sprintf("claim %s (uid %s) has %d PVs %v, want exactly one", cl.Name, cl.UID, len(got), got))
		}
		delete(perClaim, cl.UID)
	}
	for uid, names := range perClaim {
		problems = append(problems, fmt.Sprintf("PVs %v claim uid %s, which is no claim in %s", names, uid, ns))
	}
	for _, d := range dirs {
		if _, ok := byPath[d]; !ok {
			problems = append(problems, fmt.Sprintf("orphan directory %s: no PV refers to it", d))
		}
	}
	for p, pv := range byPath {
		if !slices.Contains(dirs, p) {
			problems = append(problems, fmt.Sprintf("PV %s has no directory: %s is not on disk", pv, p))
		}
	}
	slices.Sort(problems)
	return problems, nil
}

// BoundClaims counts the claims in ns that are Bound.
func BoundClaims(ctx context.Context, c kubernetes.Interface, ns string) (bound, total int, err error) {
	claims, err := c.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, 0, fmt.Errorf("list claims of %s: %w", ns, err)
	}
	for _, cl := range claims.Items {
		if cl.Status.Phase == v1.ClaimBound {
			bound++
		}
	}
	return bound, len(claims.Items), nil
}

// pvBlockedMessage is what the API server answers a blocked PV create with.
const pvBlockedMessage = "dirpv test: PV creation blocked for this claim"

// BlockPVCreation makes the API server refuse to create any PV for the named claims of ns, with
// a ValidatingAdmissionPolicy, as if the provisioner crashed after making the directory and
// before the PV was stored: the provisioner makes the directory and then fails to save the PV
// (the lib keeps retrying, then deletes the volume after about 40 s). It returns once the
// policy is in force; unblock lifts it and returns once PVs of those claims are accepted again.
func BlockPVCreation(ctx context.Context, c kubernetes.Interface, ns string, claims []string) (unblock func(context.Context) error, err error) {
	quoted := make([]string, len(claims))
	for i, cl := range claims {
		quoted[i] = strconv.Quote(cl)
	}
	name := "dirpv-test-block-pv-" + ns
	policy := &admissionv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionv1.Fail),
			MatchConstraints: &admissionv1.MatchResources{ResourceRules: []admissionv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionv1.RuleWithOperations{
					Operations: []admissionv1.OperationType{admissionv1.Create},
					Rule:       admissionv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"persistentvolumes"}},
				},
			}}},
			Validations: []admissionv1.Validation{{
				Expression: fmt.Sprintf("!has(object.spec.claimRef) || object.spec.claimRef.namespace != %s || !(object.spec.claimRef.name in [%s])",
					strconv.Quote(ns), strings.Join(quoted, ", ")),
				Message: pvBlockedMessage,
			}},
		},
	}
	binding := &admissionv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionv1.ValidatingAdmissionPolicyBindingSpec{
			PolicyName:        name,
			ValidationActions: []admissionv1.ValidationAction{admissionv1.Deny},
		},
	}
	api := c.AdmissionregistrationV1()
	if _, err := api.ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create admission policy %s: %w", name, err)
	}
	if _, err := api.ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		api.ValidatingAdmissionPolicies().Delete(ctx, name, metav1.DeleteOptions{})
		return nil, fmt.Errorf("create admission policy binding %s: %w", name, err)
	}
	unblock = func(ctx context.Context) error {
		for _, del := range []func(context.Context, string, metav1.DeleteOptions) error{
			api.ValidatingAdmissionPolicyBindings().Delete, api.ValidatingAdmissionPolicies().Delete,
		} {
			if err := del(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete admission policy %s: %w", name, err)
			}
		}
		// The API server loads policies from its informer: wait until it lets PVs through.
		return Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
			err := dryRunPV(ctx, c, ns, claims[0])
			return err == nil, fmt.Errorf("PV create for %s/%s after lifting the block: %v", ns, claims[0], err)
		})
	}
	err = Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
		err := dryRunPV(ctx, c, ns, claims[0])
		return err != nil && strings.Contains(err.Error(), pvBlockedMessage), fmt.Errorf("PV create for %s/%s: %v", ns, claims[0], err)
	})
	if err != nil {
		if uerr := unblock(ctx); uerr != nil {
			err = fmt.Errorf("%w; %w", err, uerr)
		}
		return nil, fmt.Errorf("admission policy %s never took effect: %w", name, err)
	}
	return unblock, nil
}

// dryRunPV asks the API server to create (dry run: nothing is stored) a PV for ns/claim.
func dryRunPV(ctx context.Context, c kubernetes.Interface, ns, claim string) error {
	pv := &v1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "dirpv-test-dry-run-"},
		Spec: v1.PersistentVolumeSpec{
			Capacity:    v1.ResourceList{v1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes: []v1.PersistentVolumeAccessMode{v1.ReadWriteOnce},
			ClaimRef:    &v1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: claim},
			PersistentVolumeSource: v1.PersistentVolumeSource{
				CSI: &v1.CSIPersistentVolumeSource{Driver: "dirpv.io", VolumeHandle: "dry-run"},
			},
		},
	}
	_, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
	return err
}

// KillSnapshot is what was provisioned when a provisioner was killed: how many claims were
// Bound, which directories existed (with their inode numbers) and which of them had a PV.
type KillSnapshot struct {
	Bound, Total int
	// Dir is the base or export; Dirs its entries that belong to the test, by inode.
	Dir     string
	Dirs    map[string]uint64
	PVPaths map[string]bool
	keep    func(name string) bool
}

// canaryFile is planted in the directories that had no PV at a kill. A directory made again
// by the retry lacks it, even where the file system hands out the freed inode number again.
const canaryFile = ".dirpv-test-kill-canary"

// TakeKillSnapshot records the claims of ns and the entries of dir for which keep is true, and
// plants a canary file in each directory that has no PV. Take it right after the kill: the
// killed process can no longer change either.
func TakeKillSnapshot(ctx context.Context, c kubernetes.Interface, ns, dir string, keep func(name string) bool) (*KillSnapshot, error) {
	s := &KillSnapshot{Dir: dir, PVPaths: map[string]bool{}, keep: keep}
	var err error
	if s.Bound, s.Total, err = BoundClaims(ctx, c, ns); err != nil {
		return nil, err
	}
	if s.Dirs, err = s.inodes(); err != nil {
		return nil, err
	}
	pvs, err := c.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list PVs: %w", err)
	}
	for _, pv := range pvs.Items {
		if pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == ns && pv.Spec.CSI != nil {
			s.PVPaths[pv.Spec.CSI.VolumeAttributes["path"]] = true
		}
	}
	for name := range s.Dirs {
		if s.PVPaths[name] {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, name, canaryFile), []byte(name), 0o600); err != nil {
			return nil, fmt.Errorf("plant a canary in %s: %w", name, err)
		}
	}
	return s, nil
}

// Names lists the recorded entries, sorted.
func (s *KillSnapshot) Names() []string {
	return slices.Sorted(maps.Keys(s.Dirs))
}

// Entries lists the directory's entries kept by the snapshot's filter as they are now.
func (s *KillSnapshot) Entries() ([]string, error) {
	now, err := s.inodes()
	if err != nil {
		return nil, err
	}
	return (&KillSnapshot{Dirs: now}).Names(), nil
}

func (s *KillSnapshot) inodes() (map[string]uint64, error) {
	des, err := os.ReadDir(s.Dir)
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", s.Dir, err)
	}
	out := map[string]uint64{}
	for _, d := range des {
		if !s.keep(d.Name()) {
			continue
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(s.Dir, d.Name()), &st); err != nil {
			return nil, fmt.Errorf("stat %s: %w", d.Name(), err)
		}
		out[d.Name()] = st.Ino
	}
	return out, nil
}

// CheckAdopted checks that each of the claims (of ns) is now bound to a PV whose directory
// existed at the kill, had no PV then, and is still the same directory (same inode, and the
// canary planted at the kill is in it): its
// Provision, retried after the kill, took over the directory the killed attempt had made
// rather than making another one or refusing it. It returns one line per claim for which
// that is not so.
func (s *KillSnapshot) CheckAdopted(ctx context.Context, c kubernetes.Interface, ns string, claims []string) ([]string, error) {
	var problems []string
	for _, name := range claims {
		pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get claim %s/%s: %w", ns, name, err)
		}
		if pvc.Spec.VolumeName == "" {
			problems = append(problems, fmt.Sprintf("claim %s has no PV", name))
			continue
		}
		pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("get PV of claim %s/%s: %w", ns, name, err)
		}
		p := pv.Spec.CSI.VolumeAttributes["path"]
		ino, existed := s.Dirs[p]
		var st unix.Stat_t
		statErr := unix.Lstat(filepath.Join(s.Dir, p), &st)
		switch {
		case !existed:
			problems = append(problems, fmt.Sprintf("claim %s: its directory %s did not exist at the kill", name, p))
		case s.PVPaths[p]:
			problems = append(problems, fmt.Sprintf("claim %s: its directory %s already had a PV at the kill", name, p))
		case statErr != nil:
			problems = append(problems, fmt.Sprintf("claim %s: directory %s: %v", name, p, statErr))
		case st.Ino != ino:
			problems = append(problems, fmt.Sprintf("claim %s: directory %s was replaced (inode %d at the kill, %d now)", name, p, ino, st.Ino))
		default:
			if b, err := os.ReadFile(filepath.Join(s.Dir, p, canaryFile)); err != nil || string(b) != p {
				problems = append(problems, fmt.Sprintf("claim %s: directory %s was made again: the canary planted at the kill is gone (%q, %v)", name, p, b, err))
			}
		}
	}
	return problems, nil
}
