package daemon

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Events never wait behind the writes that make volumes, nor those behind a backlog of events:
// with one token a day each, a PV create and an event both go out, and only a second PV
// create has to wait (refused at once: its wait would pass the context's deadline).
func TestEventsHaveTheirOwnRateLimiter(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{}`)
	}))
	defer srv.Close()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	must(t, os.WriteFile(kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: %q}}]
users: [{name: u, user: {}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`, srv.URL)), 0o600))
	client, err := KubeConfig{Path: kubeconfig, QPS: 1.0 / 86400, Burst: 1}.client()
	must(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pv := func(name string) error {
		_, err := client.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		return err
	}
	if err := pv("first"); err != nil {
		t.Fatalf("first PV create: %v", err)
	}
	event := &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "e", Namespace: "ns"}}
	if _, err := client.CoreV1().Events("ns").Create(ctx, event, metav1.CreateOptions{}); err != nil {
		t.Fatalf("event after a PV create, with the API limiter's only token spent: %v", err)
	}
	if _, err := client.EventsV1().Events("ns").List(ctx, metav1.ListOptions{}); !throttled(err) {
		t.Fatalf("events.k8s.io request after the events' only token was spent: got %v, want it refused by the limiter", err)
	}
	if err := pv("second"); !throttled(err) {
		t.Fatalf("second PV create: got %v, want it refused by the limiter, whose only token the first took", err)
	}
}

func throttled(err error) bool {
	return err != nil && strings.Contains(err.Error(), "rate limiter")
}
