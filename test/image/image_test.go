package image

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteOCITar(t *testing.T) {
	dir := t.TempDir()
	host := filepath.Join(dir, "hello")
	must(t, os.WriteFile(host, []byte("#!/bin/sh\necho hi\n"), 0o755))
	out := filepath.Join(dir, "img.tar")
	files := []File{
		{HostPath: host, ImagePath: "/usr/bin/hello"},
		{ImagePath: "/bin/hi", Symlink: "/usr/bin/hello"},
		{ImagePath: "/tmp", Dir: true, Mode: 0o777 | os.ModeSticky},
	}
	must(t, WriteOCITar(out, "dirpv.local/test:1", files, Config{Entrypoint: []string{"/usr/bin/hello"}}))
	f, err := os.Open(out)
	must(t, err)
	defer f.Close()
	tr := tar.NewReader(f)
	names := map[string]bool{}
	var index struct {
		Manifests []struct {
			MediaType   string            `json:"mediaType"`
			Annotations map[string]string `json:"annotations"`
			Platform    struct{ OS, Architecture string }
		} `json:"manifests"`
	}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		names[h.Name] = true
		if h.Name == "index.json" {
			must(t, json.NewDecoder(tr).Decode(&index))
		}
	}
	if !names["oci-layout"] || !names["index.json"] {
		t.Fatalf("not an OCI layout: %v", names)
	}
	if len(index.Manifests) != 1 {
		t.Fatalf("want 1 manifest, got %+v", index)
	}
	m := index.Manifests[0]
	if m.Annotations["io.containerd.image.name"] != "dirpv.local/test:1" || m.Annotations["org.opencontainers.image.ref.name"] != "1" {
		t.Errorf("annotations: %v", m.Annotations)
	}
	if m.Platform.OS != "linux" || m.Platform.Architecture != "amd64" {
		t.Errorf("platform: %+v", m.Platform)
	}
	if m.MediaType != "application/vnd.oci.image.manifest.v1+json" {
		t.Errorf("media type %s", m.MediaType)
	}

	entries, err := layerTar(files)
	must(t, err)
	lr := tar.NewReader(bytes.NewReader(entries))
	got := map[string]*tar.Header{}
	for {
		h, err := lr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		got[h.Name] = h
	}
	for _, want := range []string{"usr/", "usr/bin/", "usr/bin/hello", "bin/", "bin/hi", "tmp/"} {
		if got[want] == nil {
			t.Errorf("layer lacks %s (has %v)", want, got)
		}
	}
	if h := got["bin/hi"]; h != nil && (h.Typeflag != tar.TypeSymlink || h.Linkname != "/usr/bin/hello") {
		t.Errorf("bin/hi: %+v", h)
	}
	if h := got["usr/bin/hello"]; h != nil && h.Mode != 0o755 {
		t.Errorf("hello mode %o", h.Mode)
	}
	if h := got["tmp/"]; h != nil && h.Mode != 0o1777 {
		t.Errorf("tmp mode %o", h.Mode)
	}
}

// must stops the test on err.
func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
