package provisioner

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/dirpv/dirpv/volume"
)

// nodeServer is an API server that serves one Node, except that the GETs it is told to hang
// get no answer until the client gives up on them.
type nodeServer struct {
	*httptest.Server
	// hang is how many of the next GETs hang.
	hang atomic.Int32
	// hanging is sent to when a GET starts hanging, and ended when it stops (the client gave up).
	hanging, ended chan struct{}
}

func newNodeServer(t *testing.T, name, hostname string) *nodeServer {
	s := &nodeServer{hanging: make(chan struct{}, 10), ended: make(chan struct{}, 10)}
	node := v1.Node{
		TypeMeta:   metav1.TypeMeta{Kind: "Node", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{v1.LabelHostname: hostname}},
	}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/v1/nodes/"+name {
			http.NotFound(w, r)
			return
		}
		if s.hang.Add(-1) >= 0 {
			s.hanging <- struct{}{}
			<-r.Context().Done()
			s.ended <- struct{}{}
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(&node)
	}))
	t.Cleanup(func() {
		// Close waits for the requests under way, a hanging one too, unless its connection goes.
		s.CloseClientConnections()
		s.Close()
	})
	return s
}

func hostnameProvisioner(t *testing.T, url string) *Provisioner {
	t.Helper()
	client, err := kubernetes.NewForConfig(&rest.Config{Host: url})
	must(t, err)
	bases, err := volume.NewAllowedBases([]string{t.TempDir()}, "/var/lib/kubelet")
	must(t, err)
	p, err := New(Config{DriverName: testDriver, Role: RoleNode, NodeName: "node-h", Client: client,
		Classes: storagelisters.NewStorageClassLister(cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})), AllowedBases: bases, StateDir: t.TempDir()})
	must(t, err)
	return p
}

// TestHostnameLookupDoesNotSerialise: while one worker's GET of the node hangs (an API server
// that took the request and never answers), another worker gets the hostname from a GET of its
// own instead of queueing behind the first; the hung one ends with the client's deadline.
func TestHostnameLookupDoesNotSerialise(t *testing.T) {
	defer func(d time.Duration) { apiTimeout = d }(apiTimeout)
	apiTimeout = 3 * time.Second
	srv := newNodeServer(t, "node-h", "host-h")
	srv.hang.Store(1)
	p := hostnameProvisioner(t, srv.URL)

	// The first caller has no deadline of its own, as the lib's workers have none.
	first := make(chan error, 1)
	go func() {
		_, err := p.nodeHostname(context.Background())
		first <- err
	}()
	<-srv.hanging

	second := make(chan string, 1)
	go func() {
		h, err := p.nodeHostname(context.Background())
		if err != nil {
			t.Errorf("second lookup: %v", err)
		}
		second <- h
	}()
	// A generous bound for a test that would otherwise hang: the second GET is answered at once.
	select {
	case h := <-second:
		if h != "host-h" {
			t.Errorf("hostname %q, want host-h", h)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the second lookup waits behind the first, whose GET hangs")
	}
	select {
	case <-srv.ended:
		t.Fatal("the hung GET ended before the second lookup returned: the test proved nothing")
	default:
	}
	// Cached now: no GET at all, even one that would hang.
	srv.hang.Store(1)
	if h, err := p.nodeHostname(context.Background()); err != nil || h != "host-h" {
		t.Errorf("cached lookup: %q, %v", h, err)
	}
	srv.hang.Store(0)
	if len(srv.hanging) != 0 {
		t.Error("a lookup after the hostname was known went to the API server")
	}
	// The hung GET is not left for good: it is bounded by apiTimeout.
	select {
	case err := <-first:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("hung lookup ended with %v, want its deadline", err)
		}
	case <-time.After(apiTimeout + 30*time.Second):
		t.Fatal("the hung GET was never given up")
	}
}
