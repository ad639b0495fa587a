package integration

// Hostile claims: a tenant controls its claims' names, labels and annotations, and may aim them
// at a class whose pathPattern uses them. Each attack must either be refused with a
// ProvisioningFailed event naming the problem, or land in a directory strictly inside the
// base; nothing outside the base may change, a directory is never handed to a second claim,
// and deleting a volume never removes more than the volume's own directory.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// hostileLayout is a base directory with things around it that no claim may reach:
//
//	top/sentinel/...      beside the base's parent
//	top/etc/...           where "../../etc" from the base points
//	top/parent/sentinel/  beside the base
//	top/parent/base/      the class's basePath
type hostileLayout struct {
	top, base string
}

func newHostileLayout(t *testing.T) hostileLayout {
	t.Helper()
	// Under suite.Work.BaseRoot, which node-a allows local volumes in.
	top, err := os.MkdirTemp(suite.Work.BaseRoot, "hostile-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(top) })
	l := hostileLayout{top: top, base: filepath.Join(top, "parent", "base")}
	for _, d := range []string{"sentinel/sub", "etc", "parent/sentinel", "parent/base"} {
		must(t, os.MkdirAll(filepath.Join(top, d), 0o755))
	}
	for f, content := range map[string]string{
		"sentinel/data": "outside 1", "sentinel/sub/data": "outside 2", "etc/passwd": "root:x:0:0::/root:/bin/sh\n",
		"parent/sentinel/data": "beside the base",
	} {
		must(t, os.WriteFile(filepath.Join(top, f), []byte(content), 0o644))
	}
	return l
}

// outside hashes everything in the layout except the base's own contents.
func (l hostileLayout) outside(t *testing.T) map[string]string {
	t.Helper()
	return snapshotTree(t, l.top, func(rel string) bool { return strings.HasPrefix(rel, "parent/base/") })
}

func withLabel(k, v string) framework.ClaimOption {
	return func(c *v1.PersistentVolumeClaim) {
		if c.Labels == nil {
			c.Labels = map[string]string{}
		}
		c.Labels[k] = v
	}
}

// checkBaseChildren checks that every entry in the base is a real directory (not a symlink)
// and one of want, and that each is a direct child: nothing below it but what tests wrote.
func checkBaseChildren(t *testing.T, base string, want []string) {
	t.Helper()
	got := entries(t, base)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("base holds %q, want exactly %q", got, want)
	}
	for _, name := range got {
		fi, err := os.Lstat(filepath.Join(base, name))
		if err != nil || !fi.IsDir() {
			t.Errorf("base entry %q is not a plain directory: %v %v", name, fi, err)
		}
	}
}

// hasEvent says whether the claim has an event with reason whose message contains substr.
func hasEvent(ctx context.Context, t *testing.T, ns, claim, reason, substr string) bool {
	t.Helper()
	evs, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=" + claim})
	must(t, err)
	return slices.ContainsFunc(evs.Items, func(e v1.Event) bool {
		return e.Reason == reason && strings.Contains(e.Message, substr)
	})
}

// noPVFor fails if a PV claims ns/name. Call it once the claim's ProvisioningFailed event is
// there: the event comes after the refused attempt has returned, so a PV made by that attempt
// would already exist, and no waiting for a PV that does not come is needed.
func noPVFor(t *testing.T, ns, name string) {
	t.Helper()
	pvs, err := suite.Client.CoreV1().PersistentVolumes().List(context.Background(), metav1.ListOptions{})
	must(t, err)
	for _, pv := range pvs.Items {
		if ref := pv.Spec.ClaimRef; ref != nil && ref.Namespace == ns && ref.Name == name {
			t.Fatalf("PV %s was created for refused claim %s/%s (path %q)", pv.Name, ns, name, pv.Spec.CSI.VolumeAttributes["path"])
		}
	}
}

// Hostile annotation and label values against patterns that use them as a whole component.
func TestHostileMetadataValues(t *testing.T) {
	ns := suite.NewNamespace(t)
	layout := newHostileLayout(t)
	before := layout.outside(t)

	byAnn := suite.CreateClass(t, "hostile-ann", map[string]string{
		"backend": "local", "basePath": layout.base, "pathPattern": "${pvc.metadata.annotations['dir']}",
	})
	byLabel := suite.CreateClass(t, "hostile-label", map[string]string{
		"backend": "local", "basePath": layout.base, "pathPattern": "${pvc.metadata.name}-${pvc.metadata.labels['team']}",
	})

	const (
		refuseSlash = "may not appear"       // '/', NUL, control characters
		refuseName  = "not a directory name" // "", ".", ".."
		refuseLong  = "more than the 255"    // NAME_MAX
		refuseNoKey = "which the claim does not have"
	)
	type attack struct {
		claim, class string
		opts         []framework.ClaimOption
		// refusal is the event text expected; "" means the value is harmless and must be
		// mapped to exactly dir, a direct child of the base.
		refusal, dir string
	}
	attacks := []attack{
		{claim: "dotdot", refusal: refuseName, opts: []framework.ClaimOption{framework.Annotation("dir", "..")}},
		{claim: "up-etc", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "../../etc")}},
		{claim: "abs-etc", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "/etc")}},
		{claim: "slash", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "a/b")}},
		{claim: "trailing-slash", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "sentinel/")}},
		{claim: "nul", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "x\x00y")}},
		{claim: "nul-only", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "\x00")}},
		{claim: "long", refusal: refuseLong, opts: []framework.ClaimOption{framework.Annotation("dir", strings.Repeat("L", 300))}},
		{claim: "dot", refusal: refuseName, opts: []framework.ClaimOption{framework.Annotation("dir", ".")}},
		{claim: "empty", refusal: refuseName, opts: []framework.ClaimOption{framework.Annotation("dir", "")}},
		{claim: "newline", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "a\nb")}},
		{claim: "tab", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "\t")}},
		{claim: "escape", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "\x1b[2Jx")}},
		{claim: "del", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "x\x7f")}},
		{claim: "c1-control", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "x\u0085")}},
		// Invalid UTF-8 reaches the API server as U+FFFD (JSON), which dirpv refuses too.
		{claim: "bad-utf8", refusal: refuseSlash, opts: []framework.ClaimOption{framework.Annotation("dir", "x\xff")}},
		{claim: "no-annotation", refusal: refuseNoKey},
		// Look-alikes of "/" and "..": ordinary characters to the kernel, so they are names.
		{claim: "division-slash", dir: "\u2215etc", opts: []framework.ClaimOption{framework.Annotation("dir", "\u2215etc")}},
		{claim: "fullwidth-dots", dir: "\uff0e\uff0e", opts: []framework.ClaimOption{framework.Annotation("dir", "\uff0e\uff0e")}},
		{claim: "one-dot-leaders", dir: "\u2024\u2024", opts: []framework.ClaimOption{framework.Annotation("dir", "\u2024\u2024")}},
		{claim: "three-dots", dir: "...", opts: []framework.ClaimOption{framework.Annotation("dir", "...")}},
		{claim: "255-bytes", dir: strings.Repeat("M", 255), opts: []framework.ClaimOption{framework.Annotation("dir", strings.Repeat("M", 255))}},
		// Labels: the API server allows an empty value, which makes the component empty only
		// when the label is the whole component; here it is "<name>-", a harmless name.
		{claim: "label-empty", class: byLabel.Name, dir: "label-empty-", opts: []framework.ClaimOption{withLabel("team", "")}},
		{claim: "label-missing", class: byLabel.Name, refusal: refuseNoKey},
	}

	var harmless []string
	var created []attack
	for _, a := range attacks {
		if a.class == "" {
			a.class = byAnn.Name
		}
		opts := append([]framework.ClaimOption{framework.OnNode(nodeA)}, a.opts...)
		_, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Create(context.Background(), framework.NewClaim(ns, a.claim, a.class, opts...), metav1.CreateOptions{})
		if err != nil {
			// The API server may refuse some values itself; that is a refusal too.
			t.Logf("attack %s: the API server refused the claim: %v", a.claim, err)
			if a.refusal == "" {
				t.Errorf("attack %s: harmless value refused by the API server: %v", a.claim, err)
			}
			continue
		}
		created = append(created, a)
	}
	for _, a := range created {
		if a.refusal != "" {
			ev, err := framework.WaitForEvent(context.Background(), suite.Client, ns, "PersistentVolumeClaim", a.claim, "ProvisioningFailed", a.refusal, timeout)
			if err != nil {
				t.Errorf("attack %s: %v", a.claim, err)
				continue
			}
			t.Logf("attack %s: refused: %s", a.claim, ev.Message)
			continue
		}
		_, pv := waitBound(t, ns, a.claim)
		if got := pv.Spec.CSI.VolumeAttributes["path"]; got != a.dir {
			t.Errorf("attack %s: PV path %q, want %q", a.claim, got, a.dir)
		}
		harmless = append(harmless, a.dir)
		t.Logf("attack %s: mapped to %q inside the base", a.claim, a.dir)
	}
	// Refused claims have no PV once their refusal is reported.
	for _, a := range created {
		if a.refusal != "" {
			noPVFor(t, ns, a.claim)
		}
	}
	checkBaseChildren(t, layout.base, harmless)
	if d := framework.DiffSnapshots(before, layout.outside(t)); len(d) > 0 {
		t.Errorf("hostile claims changed things outside the base:\n%s", strings.Join(d, "\n"))
	}

	// Deleting the accepted claims removes exactly their directories.
	for _, a := range created {
		if a.refusal == "" {
			deleteClaim(t, ns, a.claim)
		}
	}
	err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
		got := entries(t, layout.base)
		return len(got) == 0, fmt.Errorf("base still holds %q", got)
	})
	if err != nil {
		t.Error(err)
	}
	if d := framework.DiffSnapshots(before, layout.outside(t)); len(d) > 0 {
		t.Errorf("deleting the claims changed things outside the base:\n%s", strings.Join(d, "\n"))
	}
	if _, err := os.Stat(layout.base); err != nil {
		t.Errorf("base itself: %v", err)
	}
}

// Two claims that expand to the same directory: the second is refused with an event naming
// the clash and never gets a PV; the first's data is untouched.
func TestHostileCollidingClaims(t *testing.T) {
	ns := suite.NewNamespace(t)
	layout := newHostileLayout(t)
	before := layout.outside(t)
	class := suite.CreateClass(t, "hostile-collide", map[string]string{
		"backend": "local", "basePath": layout.base, "pathPattern": "${pvc.metadata.annotations['dir']}",
	})

	t.Run("sequential", func(t *testing.T) {
		suite.CreateClaim(t, ns, "owner", class.Name, framework.OnNode(nodeA), framework.Annotation("dir", "shared"))
		_, pv := waitBound(t, ns, "owner")
		secret := filepath.Join(layout.base, "shared", "secret")
		must(t, os.WriteFile(secret, []byte("owner's data"), 0o600))
		suite.CreateClaim(t, ns, "thief", class.Name, framework.OnNode(nodeA), framework.Annotation("dir", "shared"))
		waitEvent(t, ns, "PersistentVolumeClaim", "thief", "ProvisioningFailed", "directory shared already exists")
		noPVFor(t, ns, "thief")
		if b, err := os.ReadFile(secret); err != nil || string(b) != "owner's data" {
			t.Errorf("owner's data after the clash: %q %v", b, err)
		}
		if pv.Spec.CSI.VolumeAttributes["path"] != "shared" {
			t.Errorf("owner's PV path %q", pv.Spec.CSI.VolumeAttributes["path"])
		}
	})

	t.Run("concurrent", func(t *testing.T) {
		// Created back to back, provisioned by concurrent workers: mkdir decides, exactly one wins.
		names := []string{"race-1", "race-2", "race-3", "race-4"}
		for _, n := range names {
			suite.CreateClaim(t, ns, n, class.Name, framework.OnNode(nodeA), framework.Annotation("dir", "contested"))
		}
		var bound, refused []string
		err := framework.Poll(context.Background(), timeout, func(ctx context.Context) (bool, error) {
			bound, refused = nil, nil
			for _, n := range names {
				c, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, n, metav1.GetOptions{})
				if err != nil {
					return false, err
				}
				if c.Status.Phase == v1.ClaimBound {
					bound = append(bound, n)
					continue
				}
				if hasEvent(ctx, t, ns, n, "ProvisioningFailed", "directory contested already exists") {
					refused = append(refused, n)
				}
			}
			return len(bound)+len(refused) == len(names), fmt.Errorf("bound %v refused %v", bound, refused)
		})
		must(t, err)
		if len(bound) != 1 {
			t.Fatalf("%d claims got directory contested: %v; want exactly one", len(bound), bound)
		}
		for _, n := range refused {
			noPVFor(t, ns, n)
		}
		t.Logf("bound %v, refused %v", bound, refused)
	})

	t.Run("left-from-earlier-pv", func(t *testing.T) {
		// onDelete retain leaves the directory after its PV; a new claim of the same name, in
		// a pattern without ${pv.metadata.name}, must not inherit it.
		retain := suite.CreateClass(t, "hostile-retain", map[string]string{
			"backend": "local", "basePath": layout.base, "onDelete": "retain",
			"pathPattern": "${pvc.metadata.namespace}-${pvc.metadata.name}",
		})
		suite.CreateClaim(t, ns, "reused", retain.Name, framework.OnNode(nodeA))
		_, pv := waitBound(t, ns, "reused")
		dir := filepath.Join(layout.base, pv.Spec.CSI.VolumeAttributes["path"])
		must(t, os.WriteFile(filepath.Join(dir, "previous-tenant"), []byte("old data"), 0o600))
		deleteClaim(t, ns, "reused")
		waitPVGone(t, pv.Name)
		suite.CreateClaim(t, ns, "reused", retain.Name, framework.OnNode(nodeA))
		waitEvent(t, ns, "PersistentVolumeClaim", "reused", "ProvisioningFailed", "already exists")
		noPVFor(t, ns, "reused")
		if b, err := os.ReadFile(filepath.Join(dir, "previous-tenant")); err != nil || string(b) != "old data" {
			t.Errorf("retained data: %q %v", b, err)
		}
	})

	if d := framework.DiffSnapshots(before, layout.outside(t)); len(d) > 0 {
		t.Errorf("colliding claims changed things outside the base:\n%s", strings.Join(d, "\n"))
	}
}

// Deleting a volume of a nested pattern removes its own directory only: the namespace
// directory above it, a sibling volume in it and the base all stay.
func TestHostileDeleteStaysAtTheLeaf(t *testing.T) {
	for _, onDelete := range []string{"delete", "archive"} {
		t.Run(onDelete, func(t *testing.T) {
			ns := suite.NewNamespace(t)
			layout := newHostileLayout(t)
			before := layout.outside(t)
			class := suite.CreateClass(t, "hostile-nested-"+onDelete, map[string]string{
				"backend": "local", "basePath": layout.base, "onDelete": onDelete,
				"pathPattern": "${pvc.metadata.namespace}/${pvc.metadata.name}",
			})
			suite.CreateClaim(t, ns, "gone", class.Name, framework.OnNode(nodeA))
			suite.CreateClaim(t, ns, "sibling", class.Name, framework.OnNode(nodeA))
			_, gonePV := waitBound(t, ns, "gone")
			_, sibPV := waitBound(t, ns, "sibling")
			if p := gonePV.Spec.CSI.VolumeAttributes["path"]; p != ns+"/gone" {
				t.Fatalf("path %q, want %s/gone", p, ns)
			}
			for _, pv := range []*v1.PersistentVolume{gonePV, sibPV} {
				dir := filepath.Join(layout.base, pv.Spec.CSI.VolumeAttributes["path"])
				must(t, os.MkdirAll(filepath.Join(dir, "deep/er"), 0o755))
				must(t, os.WriteFile(filepath.Join(dir, "deep/er/data"), []byte(pv.Name), 0o644))
			}
			// A tenant's symlinks to the sibling and the namespace directory must not make
			// Delete or archive follow them.
			goneDir := filepath.Join(layout.base, ns, "gone")
			for name, target := range map[string]string{"to-sibling": filepath.Join(layout.base, ns, "sibling"),
				"to-ns": filepath.Join(layout.base, ns), "to-base": layout.base, "up": "../.."} {
				must(t, os.Symlink(target, filepath.Join(goneDir, name)))
			}
			sibBefore := snapshotTree(t, filepath.Join(layout.base, ns, "sibling"), nil)

			deleteClaim(t, ns, "gone")
			waitPVGone(t, gonePV.Name)
			nsEntries := entries(t, filepath.Join(layout.base, ns))
			switch onDelete {
			case "delete":
				if !slices.Equal(nsEntries, []string{"sibling"}) {
					t.Errorf("namespace directory after delete holds %q, want only sibling", nsEntries)
				}
			case "archive":
				if len(nsEntries) != 2 || !strings.HasPrefix(nsEntries[0], "archived-gone-") || nsEntries[1] != "sibling" {
					t.Errorf("namespace directory after archive holds %q, want archived-gone-<time> and sibling", nsEntries)
				}
			}
			if d := framework.DiffSnapshots(sibBefore, snapshotTree(t, filepath.Join(layout.base, ns, "sibling"), nil)); len(d) > 0 {
				t.Errorf("sibling volume changed:\n%s", strings.Join(d, "\n"))
			}
			if got := entries(t, layout.base); !slices.Equal(got, []string{ns}) {
				t.Errorf("base holds %q, want only the namespace directory", got)
			}

			// The last volume in the namespace directory goes; the directory and base stay.
			deleteClaim(t, ns, "sibling")
			waitPVGone(t, sibPV.Name)
			if fi, err := os.Stat(filepath.Join(layout.base, ns)); err != nil || !fi.IsDir() {
				t.Errorf("namespace directory after the last delete: %v", err)
			}
			if fi, err := os.Stat(layout.base); err != nil || !fi.IsDir() {
				t.Errorf("base after the last delete: %v", err)
			}
			if d := framework.DiffSnapshots(before, layout.outside(t)); len(d) > 0 {
				t.Errorf("deletes changed things outside the base:\n%s", strings.Join(d, "\n"))
			}
		})
	}
}

// Secrets handed to the node plugin (CSI request Secrets, which kubelet fills when a class
// names a node-publish secret) and secret-looking class parameters never reach logs, events or
// PVs. dirpv uses no credentials; the CSI logging interceptor logs selected fields only.
func TestHostileSecretsNeverLogged(t *testing.T) {
	const canary = "canary-hunter2-9f1c"
	ns := suite.NewNamespace(t)
	layout := newHostileLayout(t)
	must(t, os.Mkdir(filepath.Join(layout.base, "vol"), 0o777))
	node := nodeAClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	secrets := map[string]string{"password": canary, "token": canary}
	target := filepath.Join(t.TempDir(), "target")
	good := map[string]string{"backend": "local", "basePath": layout.base, "path": "vol"}
	if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: "local:secret-test", TargetPath: target, VolumeCapability: mountRWO,
		VolumeContext: good, Secrets: secrets,
	}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "local:secret-test", TargetPath: target}); err != nil {
		t.Fatalf("unpublish: %v", err)
	}
	// Failing calls log their error: the error must not carry the secrets either.
	for _, vc := range []map[string]string{
		{"backend": "bogus", "path": "vol"},
		{"backend": "local", "basePath": layout.base, "path": "../vol"},
		{"backend": "local", "basePath": layout.base, "path": "vol", "password": "x"},
	} {
		if _, err := node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: "local:secret-test", TargetPath: target, VolumeCapability: mountRWO,
			VolumeContext: vc, Secrets: secrets,
		}); err == nil {
			t.Errorf("publish with context %v succeeded", vc)
		} else if strings.Contains(err.Error(), canary) {
			t.Errorf("publish error carries the secret: %v", err)
		}
	}
	// A class with a secret-looking parameter is refused by name, never by value.
	class := suite.CreateClass(t, "hostile-secret-param", map[string]string{
		"backend": "local", "basePath": layout.base, "nfsPassword": canary,
	})
	suite.CreateClaim(t, ns, "c", class.Name, framework.OnNode(nodeA))
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "c", "ProvisioningFailed", "nfsPassword")
	if strings.Contains(ev.Message, canary) {
		t.Errorf("event carries the parameter's value: %s", ev.Message)
	}
	evs, err := suite.Client.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{})
	must(t, err)
	for _, e := range evs.Items {
		if strings.Contains(e.Message, canary) {
			t.Errorf("event %s: %s", e.Reason, e.Message)
		}
	}
	pvs, err := suite.Client.CoreV1().PersistentVolumes().List(context.Background(), metav1.ListOptions{})
	must(t, err)
	for _, pv := range pvs.Items {
		if strings.Contains(fmt.Sprint(pv.Spec, pv.Annotations), canary) {
			t.Errorf("PV %s carries the secret", pv.Name)
		}
	}
	for _, p := range []*framework.Process{nodeProc, ctrlProc} {
		b, err := os.ReadFile(p.Log)
		must(t, err)
		if p == nodeProc && !strings.Contains(string(b), "local:secret-test") {
			t.Errorf("%s log does not mention the test volume: the calls above were not logged at all", p.Name)
		}
		if strings.Contains(string(b), canary) {
			t.Errorf("%s log carries the secret", p.Name)
		}
	}
}

// Two classes share a base with patterns of different depths. A tenant of the shallow class
// names its volume after a team; a claim of the deep class for that team must not get a
// directory inside the tenant's volume (where the tenant could read it, and its deletion
// would delete it). The reverse order, the team directory first, refuses the shallow claim.
func TestHostileVolumeInsideAnotherVolume(t *testing.T) {
	ns := suite.NewNamespace(t)
	layout := newHostileLayout(t)
	before := layout.outside(t)
	shallow := suite.CreateClass(t, "hostile-shallow", map[string]string{
		"backend": "local", "basePath": layout.base, "pathPattern": "${pvc.metadata.annotations['dir']}",
	})
	deep := suite.CreateClass(t, "hostile-deep", map[string]string{
		"backend": "local", "basePath": layout.base,
		"pathPattern": "${pvc.metadata.labels['team']}/${pvc.metadata.namespace}-${pvc.metadata.name}-${pv.metadata.name}",
	})

	suite.CreateClaim(t, ns, "squatter", shallow.Name, framework.OnNode(nodeA), framework.Annotation("dir", "finance"))
	waitBound(t, ns, "squatter")
	suite.CreateClaim(t, ns, "victim", deep.Name, framework.OnNode(nodeA), withLabel("team", "finance"))
	ev := waitEvent(t, ns, "PersistentVolumeClaim", "victim", "ProvisioningFailed", "another volume's directory")
	t.Logf("victim refused: %s", ev.Message)
	noPVFor(t, ns, "victim")
	if got := entries(t, filepath.Join(layout.base, "finance")); len(got) != 0 {
		t.Errorf("squatter's volume holds %q: a volume was created inside it", got)
	}

	// The other order: the deep class's team directory exists, the shallow claim is refused.
	suite.CreateClaim(t, ns, "ops-member", deep.Name, framework.OnNode(nodeA), withLabel("team", "ops"))
	_, pv := waitBound(t, ns, "ops-member")
	suite.CreateClaim(t, ns, "ops-squatter", shallow.Name, framework.OnNode(nodeA), framework.Annotation("dir", "ops"))
	waitEvent(t, ns, "PersistentVolumeClaim", "ops-squatter", "ProvisioningFailed", "directory ops already exists")
	noPVFor(t, ns, "ops-squatter")
	if got := entries(t, filepath.Join(layout.base, "ops")); !slices.Equal(got, []string{filepath.Base(pv.Spec.CSI.VolumeAttributes["path"])}) {
		t.Errorf("ops holds %q", got)
	}
	if d := framework.DiffSnapshots(before, layout.outside(t)); len(d) > 0 {
		t.Errorf("changed things outside the base:\n%s", strings.Join(d, "\n"))
	}
}

// snapshotTree snapshots root with framework.SnapshotTree, failing the test on error.
func snapshotTree(t *testing.T, root string, skip func(rel string) bool) map[string]string {
	t.Helper()
	s, err := framework.SnapshotTree(root, skip)
	must(t, err)
	return s
}
