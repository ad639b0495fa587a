package integration

// NFS for real: these tests run against the real NFS-Ganesha in nfsServer (and a second,
// root-squashing one), reached by `dirpv controller` through the test-only FUSE mount helper.
// They check what a user or an admin would check: the claim binds, the directory shows up on
// the server with the class's mode and owner, the PV says how to mount it, the class's mount
// options reach the mount, and a dead or hung server gives an event rather than a wedged
// controller.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
	"github.com/dirpv/dirpv/test/nfs"
	"github.com/dirpv/dirpv/volume"
)

// ctrlOperationTimeout is the controller's --operation-timeout in main_test.go.
const ctrlOperationTimeout = 10 * time.Second

// nfsClassName derives a StorageClass name from the test's name, as localClass does.
func nfsClassName(t *testing.T) string {
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 60 {
		name = name[len(name)-60:]
	}
	return strings.Trim(name, "-")
}

// nfsClass creates an Immediate StorageClass for srv's export. Its mountOptions are srv's
// port options (the portmapper only knows the last server started) followed by extra; tests
// pass distinct extra options so that their class gets its own controller mount.
func nfsClass(t *testing.T, srv *nfs.Server, extra []string, params map[string]string, opts ...framework.ClassOption) *storagev1.StorageClass {
	t.Helper()
	p := map[string]string{"backend": "nfs", "server": srv.Addr, "share": srv.Share}
	maps.Copy(p, params)
	mo := append(srv.MountOptions(), extra...)
	opts = append([]framework.ClassOption{framework.Immediate, func(c *storagev1.StorageClass) { c.MountOptions = mo }}, opts...)
	return suite.CreateClass(t, nfsClassName(t), p, opts...)
}

// waitNFSBound is waitBound with the controller's log in the failure message.
func waitNFSBound(t *testing.T, ns, name string) (*v1.PersistentVolumeClaim, *v1.PersistentVolume) {
	t.Helper()
	ctx := context.Background()
	pvc, err := framework.WaitForPVCBound(ctx, suite.Client, ns, name, timeout)
	if err != nil {
		t.Fatalf("%v\n--- controller log tail:\n%s", err, ctrlProc.Tail(4000))
	}
	pv, err := suite.Client.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get PV of claim %s/%s: %v", ns, name, err)
	}
	return pvc, pv
}

// controllerWorkDir is the controller's --work-dir, under which it mounts NFS exports.
func controllerWorkDir(t *testing.T) string {
	t.Helper()
	for i, a := range ctrlProc.Args {
		if a == "--work-dir" && i+1 < len(ctrlProc.Args) {
			return ctrlProc.Args[i+1]
		}
		if v, ok := strings.CutPrefix(a, "--work-dir="); ok {
			return v
		}
	}
	t.Fatalf("controller started without --work-dir: %q", ctrlProc.Args)
	return ""
}

// nfsMount is one FUSE NFS mount (see test/nfs) and what the mount helper recorded about it.
type nfsMount struct {
	dir string
	rec *nfs.MountRecord
}

// controllerMountsOf lists the live fuse.nfs mounts under the controller's work dir of srv's
// export with exactly the given options, as the kernel sees them (/proc/self/mountinfo: the
// test and the controller share the mount namespace). Mounts stacked on one directory count
// once each.
func controllerMountsOf(t *testing.T, srv *nfs.Server, options []string) []nfsMount {
	t.Helper()
	infos, err := framework.MountInfosUnder(controllerWorkDir(t))
	if err != nil {
		t.Fatal(err)
	}
	var out []nfsMount
	for _, mi := range infos {
		if mi.FsType != "fuse.nfs" {
			continue
		}
		rec, err := nfs.ReadMountRecord(mi.MountPoint)
		if err != nil {
			t.Fatalf("fuse.nfs mount at %s has no record: %v", mi.MountPoint, err)
		}
		if rec.Source == srv.Source("") && slices.Equal(rec.Options, options) {
			out = append(out, nfsMount{dir: mi.MountPoint, rec: rec})
		}
	}
	return out
}

// claimsOnServer lists the names in srv's export that belong to namespace ns: the default
// path pattern starts with the namespace and archived directories keep it after "archived-".
func claimsOnServer(t *testing.T, srv *nfs.Server, ns string) []string {
	t.Helper()
	var out []string
	for _, n := range entries(t, srv.ExportDir) {
		if strings.HasPrefix(strings.TrimPrefix(n, "archived-"), ns+"-") {
			out = append(out, n)
		}
	}
	return out
}

// waitClaimEvent waits for a ProvisioningFailed event on the claim mentioning substr; on
// failure it shows the claim's events and the controller's log.
func waitClaimEvent(t *testing.T, ns, claim, substr string, within time.Duration) *v1.Event {
	t.Helper()
	ev, err := framework.WaitForEvent(context.Background(), suite.Client, ns, "PersistentVolumeClaim", claim, "ProvisioningFailed", substr, within)
	if err != nil {
		t.Fatalf("%v\nclaim events: %s\n--- controller log tail:\n%s", err, framework.EventsOf(context.Background(), suite.Client, ns, "PersistentVolumeClaim", claim), ctrlProc.Tail(4000))
	}
	return ev
}

// A user creates an RWX claim on an NFS class; it binds without any pod, the directory is on
// the server with the class's mode and owner, and the PV carries everything needed to mount it
// on any node.
func TestNFSClaimBindsRWX(t *testing.T) {
	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, []string{"nolock", "actimeo=1"}, map[string]string{"mode": "0750", "uid": "1001", "gid": "2002"})
	suite.CreateClaim(t, ns, "shared", class.Name, framework.AccessModes(v1.ReadWriteMany))
	_, pv := waitNFSBound(t, ns, "shared")

	rel := ns + "-shared-" + pv.Name
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(suite.NFS.ExportDir, rel), &st); err != nil {
		t.Fatalf("volume directory on the server: %v (export holds %v)", err, entries(t, suite.NFS.ExportDir))
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Mode&0o7777 != 0o750 || st.Uid != 1001 || st.Gid != 2002 {
		t.Errorf("directory on the server: mode %o owner %d:%d, want a directory 0750 1001:2002", st.Mode, st.Uid, st.Gid)
	}
	if pv.Spec.NodeAffinity != nil {
		t.Errorf("NFS PV has node affinity %+v; it must be usable from every node", pv.Spec.NodeAffinity)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != "dirpv.io" {
		t.Fatalf("PV source = %+v, want CSI dirpv.io", pv.Spec.PersistentVolumeSource)
	}
	want := map[string]string{"backend": "nfs", "server": suite.NFS.Addr, "share": suite.NFS.Share, "path": rel}
	if got := pv.Spec.CSI.VolumeAttributes; !maps.Equal(got, want) {
		t.Errorf("volume attributes = %v, want %v", got, want)
	}
	if !slices.Equal(pv.Spec.MountOptions, class.MountOptions) {
		t.Errorf("PV mountOptions = %q, want the class's %q", pv.Spec.MountOptions, class.MountOptions)
	}
	if !slices.Equal(pv.Spec.AccessModes, []v1.PersistentVolumeAccessMode{v1.ReadWriteMany}) {
		t.Errorf("PV access modes = %v, want [ReadWriteMany]", pv.Spec.AccessModes)
	}
}

// Each onDelete policy, checked on the server after the user deletes the claim.
func TestNFSOnDelete(t *testing.T) {
	for _, policy := range []string{"delete", "retain", "archive"} {
		t.Run(policy, func(t *testing.T) {
			ns := suite.NewNamespace(t)
			class := nfsClass(t, suite.NFS, []string{"nolock"}, map[string]string{"onDelete": policy})
			suite.CreateClaim(t, ns, "c", class.Name, framework.AccessModes(v1.ReadWriteMany))
			_, pv := waitNFSBound(t, ns, "c")
			rel := pv.Spec.CSI.VolumeAttributes["path"]
			// A file inside, so that delete has a tree to remove and archive something to keep.
			if err := os.WriteFile(filepath.Join(suite.NFS.ExportDir, rel, "data"), []byte("keep me?"), 0o644); err != nil {
				t.Fatal(err)
			}
			deleteClaim(t, ns, "c")
			waitPVGone(t, pv.Name)
			got := claimsOnServer(t, suite.NFS, ns)
			switch policy {
			case "delete":
				if len(got) != 0 {
					t.Errorf("export after delete holds %v, want nothing of %s", got, ns)
				}
				// The tree itself goes in the background, from the trash.
				trashed := filepath.Join(suite.NFS.ExportDir, trashOnServer, pv.Name)
				err := framework.Poll(context.Background(), timeout, func(context.Context) (bool, error) {
					_, err := os.Lstat(trashed)
					return errors.Is(err, os.ErrNotExist), err
				})
				if err != nil {
					t.Errorf("deleted volume in the trash: %v", err)
				}
			case "retain":
				if !slices.Equal(got, []string{rel}) {
					t.Errorf("export after retain holds %v, want [%s]", got, rel)
				}
			case "archive":
				if len(got) != 1 || !strings.HasPrefix(got[0], "archived-"+rel+"-") {
					t.Fatalf("export after archive holds %v, want archived-%s-<time>", got, rel)
				}
				if b, err := os.ReadFile(filepath.Join(suite.NFS.ExportDir, got[0], "data")); err != nil || string(b) != "keep me?" {
					t.Errorf("archived data = %q, %v; want the file kept", b, err)
				}
			}
		})
	}
}

// The class's mountOptions are what the controller mounts the export with.
func TestNFSMountOptionsReachControllerMount(t *testing.T) {
	ns := suite.NewNamespace(t)
	extra := []string{"nolock", "noatime", "timeo=123", "vers=3"}
	class := nfsClass(t, suite.NFS, extra, nil)
	suite.CreateClaim(t, ns, "c", class.Name, framework.AccessModes(v1.ReadWriteMany))
	waitNFSBound(t, ns, "c")

	// Idle unmount (5m) is far away, so the mount is still there.
	mounts := controllerMountsOf(t, suite.NFS, class.MountOptions)
	if len(mounts) != 1 {
		t.Fatalf("controller mounts of %s with options %q: %d, want 1", suite.NFS.Source(""), class.MountOptions, len(mounts))
	}
	rec := mounts[0].rec
	if rec.FSType != "nfs" || rec.Source != suite.NFS.Source("") || rec.ReadOnly {
		t.Errorf("mount record %+v, want a read-write nfs mount of %s", rec, suite.NFS.Source(""))
	}
	t.Logf("controller mount %s options %q", mounts[0].dir, rec.Options)
}

// Many claims on one class cost one mount of the export, not one each.
func TestNFSManyClaimsShareOneMount(t *testing.T) {
	const n = 20
	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, []string{"nolock", "actimeo=20"}, nil)
	start := time.Now()
	createClaims(t, ns, class.Name, n, framework.AccessModes(v1.ReadWriteMany))
	for i := range n {
		waitNFSBound(t, ns, fmt.Sprintf("c-%03d", i))
	}
	t.Logf("%d claims bound in %s", n, time.Since(start).Round(time.Millisecond))
	if got := claimsOnServer(t, suite.NFS, ns); len(got) != n {
		t.Errorf("export holds %d directories of %s, want %d: %v", len(got), ns, n, got)
	}
	if mounts := controllerMountsOf(t, suite.NFS, class.MountOptions); len(mounts) != 1 {
		t.Errorf("controller mounts of the export for this class: %v, want exactly one", mounts)
	}
}

// trashOnServer is where dirpv controller moves deleted NFS volumes until their trees are
// removed (provisioner/trash.go).
const trashOnServer = ".dirpv-trash"

// fillOnServer creates files empty files under dir on the server's side of the export,
// spread over subdirectories: fast, and what a tenant's volume looks like to the server.
func fillOnServer(t *testing.T, dir string, files int) {
	t.Helper()
	const perDir = 1000
	for d := 0; d*perDir < files; d++ {
		sub := filepath.Join(dir, "d"+strconv.Itoa(d))
		if err := os.Mkdir(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		fd, err := unix.Open(sub, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < perDir && d*perDir+i < files; i++ {
			f, err := unix.Openat(fd, strconv.Itoa(i), unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
			if err != nil {
				unix.Close(fd)
				t.Fatal(err)
			}
			unix.Close(f)
		}
		unix.Close(fd)
	}
}

// Deleting a claim whose volume holds 100k files does not take the export down: the PV goes
// within the usual wait though removing the tree over NFS takes longer than the controller's
// operation timeout, another claim on the same export binds meanwhile on the same mount, and
// the tree is eventually gone from the server.
func TestNFSLargeDeleteKeepsExportServing(t *testing.T) {
	const files = 100_000
	ns := suite.NewNamespace(t)
	class := nfsClass(t, suite.NFS, []string{"nolock", "actimeo=2"}, nil)
	suite.CreateClaim(t, ns, "big", class.Name, framework.AccessModes(v1.ReadWriteMany))
	_, pv := waitNFSBound(t, ns, "big")
	rel := pv.Spec.CSI.VolumeAttributes["path"]
	fillOnServer(t, filepath.Join(suite.NFS.ExportDir, rel), files)

	start := time.Now()
	deleteClaim(t, ns, "big")
	waitPVGone(t, pv.Name)
	pvGone := time.Since(start)
	if _, err := os.Lstat(filepath.Join(suite.NFS.ExportDir, rel)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("volume directory on the server after its PV is gone: %v, want it gone from its name", err)
	}
	suite.CreateClaim(t, ns, "meanwhile", class.Name, framework.AccessModes(v1.ReadWriteMany))
	waitNFSBound(t, ns, "meanwhile")
	bound := time.Since(start)
	trashed := filepath.Join(suite.NFS.ExportDir, trashOnServer, pv.Name)
	if _, err := os.Lstat(trashed); err != nil {
		t.Errorf("%s after the second claim bound: %v; want the tree still being removed, "+
			"else this test cannot show that the export serves claims meanwhile", trashed, err)
	}
	if mounts := controllerMountsOf(t, suite.NFS, class.MountOptions); len(mounts) != 1 {
		t.Errorf("controller mounts of the export while the tree is removed: %d, want the one it had", len(mounts))
	}

	err := framework.Poll(context.Background(), 10*time.Minute, func(context.Context) (bool, error) {
		if _, err := os.Lstat(trashed); errors.Is(err, os.ErrNotExist) {
			return true, nil
		} else if err != nil {
			return false, err
		}
		return false, fmt.Errorf("%s is still on the server", trashed)
	})
	if err != nil {
		t.Fatalf("%v\n--- controller log tail:\n%s", err, ctrlProc.Tail(4000))
	}
	t.Logf("%d files: PV gone after %v, second claim bound after %v, tree gone from the server after %v",
		files, pvGone.Round(time.Millisecond), bound.Round(time.Millisecond), time.Since(start).Round(time.Second))
}

// controllerGoroutines scrapes go_goroutines from the controller's /metrics.
func controllerGoroutines(ctx context.Context) (int, error) {
	if ctrlProc.HTTPAddr == "" {
		return 0, fmt.Errorf("controller has no metrics address (started without framework.StartDirpv?)")
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+ctrlProc.HTTPAddr+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, fmt.Errorf("scrape controller metrics: %w", err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 8<<20))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_goroutines "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return int(f), err
		}
	}
	return 0, fmt.Errorf("no go_goroutines in controller metrics (%v)", sc.Err())
}

// A dead server (killed: connections refused) and a hung one (paused: connections accepted,
// nothing answered) each give the user a ProvisioningFailed event within the operation
// timeout that says what failed, cost the controller a bounded number of goroutines, and once
// the server is back the claims bind without restarting anything. "warm" claims use a class
// whose export the controller had mounted before the outage (calls fail on the mount), "cold"
// ones a class it must mount during the outage.
func TestNFSDeadServer(t *testing.T) {
	src := regexp.QuoteMeta(volume.ExportSource(suite.NFS.Addr, suite.NFS.Share))
	// On a mounted export, either the NFS client gives up first (EIO: the test FUSE client has
	// a 5 s deadline per call, like a soft kernel mount) or dirpv's operation deadline does.
	// Errors other than dirpv's own deadline name the export ("in NFS export server:share").
	export := `( in NFS export ` + src + `)?`
	warmSays := `create directory %s-warm-pvc-\S+` + export + `: ((open|mkdir) \S+ in \S+: (openat2 \S+: )?input/output error|NFS ` + src + `: NFS server did not answer in time)`
	for _, tc := range []struct {
		name     string
		down, up func() error
		// The events' messages; %s is the namespace.
		warmSays, coldSays string
	}{
		{
			name: "killed",
			down: suite.NFS.Kill,
			up:   func() error { return suite.NFS.Resume(context.Background()) },
			// The mount helper is refused at once, and says so.
			warmSays: warmSays,
			coldSays: `(?s)create directory %s-cold-pvc-\S+` + export + `: mount NFS ` + src + ` with options .*connection refused`,
		},
		{
			name: "paused",
			down: suite.NFS.Pause,
			up:   suite.NFS.Unpause,
			// The mount hangs until the controller's deadline gives up on it.
			warmSays: warmSays,
			coldSays: `create directory %s-cold-pvc-\S+: mount NFS ` + src + `: NFS server did not answer in time`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			ns := suite.NewNamespace(t)
			warm := nfsClass(t, suite.NFS, []string{"nolock", "retrans=" + tc.name + "-warm"}, nil)
			// The cold class's options are unique to this run, so no earlier mount exists.
			cold := suite.CreateClass(t, nfsClassName(t)+"-cold", map[string]string{"backend": "nfs", "server": suite.NFS.Addr, "share": suite.NFS.Share},
				framework.Immediate, func(c *storagev1.StorageClass) {
					c.MountOptions = append(suite.NFS.MountOptions(), "nolock", fmt.Sprintf("retrans=%s-%d", tc.name, time.Now().UnixNano()))
				})
			suite.CreateClaim(t, ns, "before", warm.Name, framework.AccessModes(v1.ReadWriteMany))
			waitNFSBound(t, ns, "before")
			baseline, err := controllerGoroutines(ctx)
			if err != nil {
				t.Fatal(err)
			}

			if err := tc.down(); err != nil {
				t.Fatalf("take the NFS server down: %v", err)
			}
			serverUp := false
			bringUp := func() {
				if !serverUp {
					if err := tc.up(); err != nil {
						t.Fatalf("bring the NFS server back: %v", err)
					}
					serverUp = true
				}
			}
			// Whatever happens, later tests need the server.
			t.Cleanup(func() {
				if !serverUp {
					tc.up()
				}
			})

			down := time.Now()
			suite.CreateClaim(t, ns, "warm", warm.Name, framework.AccessModes(v1.ReadWriteMany))
			suite.CreateClaim(t, ns, "cold", cold.Name, framework.AccessModes(v1.ReadWriteMany))
			// Meanwhile, sample the controller's goroutines: abandoned calls must not pile up.
			peak := baseline
			sampleDone := make(chan struct{})
			sampleCtx, stopSampling := context.WithCancel(ctx)
			defer stopSampling()
			go func() {
				defer close(sampleDone)
				for {
					if n, err := controllerGoroutines(sampleCtx); err == nil && n > peak {
						peak = n
					}
					select {
					case <-sampleCtx.Done():
						return
					case <-time.After(500 * time.Millisecond):
					}
				}
			}()
			for c, says := range map[string]string{"warm": tc.warmSays, "cold": tc.coldSays} {
				// Every call is bounded by the operation timeout; the slack is for the API round
				// trips of a loaded CI machine, not for a hung call, which never reports.
				ev := waitClaimEvent(t, ns, c, "create directory "+ns+"-"+c+"-", ctrlOperationTimeout+20*time.Second-time.Since(down))
				t.Logf("claim %s: ProvisioningFailed %s after the server went down: %s", c, time.Since(down).Round(time.Millisecond), ev.Message)
				if re := regexp.MustCompile(fmt.Sprintf(says, ns)); !re.MatchString(ev.Message) {
					t.Errorf("claim %s: event %q does not match %q", c, ev.Message, re)
				}
			}
			// Let the lib retry once more (every 15s) against the dead server.
			err = framework.Poll(ctx, time.Minute, func(ctx context.Context) (bool, error) {
				evs, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=ProvisioningFailed"})
				if err != nil {
					return false, err
				}
				var n int32
				for _, e := range evs.Items {
					n += max(e.Count, 1)
				}
				return n >= 4, fmt.Errorf("%d ProvisioningFailed events so far", n)
			})
			stopSampling()
			<-sampleDone
			if err != nil {
				t.Errorf("retries while the server is down: %v", err)
			}
			if exited, err := ctrlProc.Exited(); exited {
				t.Fatalf("controller exited while the server was down: %v\n%s", err, ctrlProc.Tail(4000))
			}
			t.Logf("controller goroutines: %d before the outage, peak %d during it", baseline, peak)
			// Each export caps its stuck calls (maxStuckCalls = 8); two exports, plus the
			// helpers' exec goroutines and HTTP scrapes, stay well under 100.
			if peak > baseline+100 {
				t.Errorf("controller goroutines went from %d to %d while the server was down; abandoned calls pile up", baseline, peak)
			}
			for _, c := range []string{"warm", "cold"} {
				if pvc, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, c, metav1.GetOptions{}); err != nil {
					t.Error(err)
				} else if pvc.Status.Phase == v1.ClaimBound {
					t.Errorf("claim %s bound while the server is down", c)
				}
			}

			bringUp()
			up := time.Now()
			for _, c := range []string{"warm", "cold"} {
				waitNFSBound(t, ns, c)
			}
			t.Logf("claims bound %s after the server came back", time.Since(up).Round(time.Millisecond))
			if got := claimsOnServer(t, suite.NFS, ns); len(got) != 3 {
				t.Errorf("export holds %v for %s, want three directories", got, ns)
			}
			// Once the server answers, the abandoned calls end too.
			err = framework.Poll(ctx, 90*time.Second, func(ctx context.Context) (bool, error) {
				n, err := controllerGoroutines(ctx)
				if err != nil {
					return false, err
				}
				return n <= baseline+20, fmt.Errorf("controller has %d goroutines, %d before the outage", n, baseline)
			})
			if err != nil {
				t.Errorf("goroutines after recovery: %v", err)
			}
			// Exactly one mount per class, not one left behind per failed attempt.
			for _, c := range []*storagev1.StorageClass{warm, cold} {
				if m := controllerMountsOf(t, suite.NFS, c.MountOptions); len(m) != 1 {
					t.Errorf("controller mounts for class %s after recovery: %v, want one", c.Name, m)
				}
			}
		})
	}
}

// On an export with root_squash, the controller's root is the anonymous user there: it can
// create directories (the export is world-writable) but not give them away. A class with
// uid/gid must say so on the claim; a class without them works.
func TestNFSRootSquash(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv, err := nfs.Start(ctx, nfs.Options{Squash: nfs.SquashRoot})
	if err != nil {
		t.Fatalf("start a root-squashing NFS server: %v", err)
	}
	t.Cleanup(func() { srv.Stop() })

	t.Run("uid-gid", func(t *testing.T) {
		ns := suite.NewNamespace(t)
		class := nfsClass(t, srv, []string{"nolock"}, map[string]string{"uid": "1001", "gid": "2002"})
		suite.CreateClaim(t, ns, "c", class.Name, framework.AccessModes(v1.ReadWriteMany))
		ev := waitClaimEvent(t, ns, "c", "root_squash", timeout)
		t.Logf("event: %s", ev.Message)
		for _, want := range []string{"chown", "1001:2002", "no_root_squash"} {
			if !strings.Contains(ev.Message, want) {
				t.Errorf("event %q does not mention %q", ev.Message, want)
			}
		}
		// The lib retries every 15s; a retry must fail the same way rather than find the
		// directory the first attempt made and hand it over owned by nobody.
		err := framework.Poll(context.Background(), time.Minute, func(ctx context.Context) (bool, error) {
			evs, err := suite.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=ProvisioningFailed"})
			if err != nil {
				return false, err
			}
			var n int32
			for _, e := range evs.Items {
				n += max(e.Count, 1)
			}
			return n >= 2, fmt.Errorf("%d ProvisioningFailed events so far", n)
		})
		if err != nil {
			t.Errorf("no second attempt: %v", err)
		}
		pvc, err := suite.Client.CoreV1().PersistentVolumeClaims(ns).Get(context.Background(), "c", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if pvc.Status.Phase != v1.ClaimPending {
			t.Errorf("claim after the retry is %s, want Pending (events: %s)", pvc.Status.Phase, framework.EventsOf(context.Background(), suite.Client, ns, "PersistentVolumeClaim", "c"))
		}
		if got := claimsOnServer(t, srv, ns); len(got) != 0 {
			t.Errorf("a refused claim left %v on the server", got)
		}
	})
	t.Run("no-owner", func(t *testing.T) {
		ns := suite.NewNamespace(t)
		class := nfsClass(t, srv, []string{"nolock", "noac"}, nil)
		suite.CreateClaim(t, ns, "c", class.Name, framework.AccessModes(v1.ReadWriteMany))
		_, pv := waitNFSBound(t, ns, "c")
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(srv.ExportDir, pv.Spec.CSI.VolumeAttributes["path"]), &st); err != nil {
			t.Fatalf("volume directory on the server: %v", err)
		}
		if st.Mode&0o7777 != 0o777 {
			t.Errorf("directory mode %o, want the default 0777 so that pods of any user can write", st.Mode&0o7777)
		}
	})
}
