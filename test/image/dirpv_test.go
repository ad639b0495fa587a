package image

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The shipped binary keeps the linker's dead-code elimination of methods: nothing in it calls
// reflect's Method or MethodByName with a name unknown at link time (text/template does, and
// gRPC's tracing brought it in until DirpvTags left that out). One such call anywhere makes the
// linker keep every exported method of every type it keeps, 11 MiB more code.
func TestDirpvKeepsMethodDeadCodeElimination(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: links dirpv")
	}
	args := DirpvBuildArgs("v0.0.0-dcetest")
	i := slices.Index(args, "-ldflags")
	if i < 0 {
		t.Fatalf("no -ldflags in %v", args)
	}
	// -dumpdep prints the linker's reachability graph, marking each function that calls
	// reflect's method lookups by name.
	args[i+1] += " -dumpdep"
	cmd := exec.CommandContext(t.Context(), "go", append(args, "-o", filepath.Join(t.TempDir(), "dirpv"), "./cmd/dirpv")...)
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	var graph bytes.Buffer
	cmd.Stderr = &graph
	if err := cmd.Run(); err != nil {
		t.Fatalf("go %v: %v\n%s", args, err, graph.String()[:min(graph.Len(), 4000)])
	}
	var marked []string
	for _, line := range strings.Split(graph.String(), "\n") {
		if from, _, ok := strings.Cut(line, " -> "); ok && strings.HasSuffix(from, " <ReflectMethod>") {
			if f := strings.TrimSuffix(from, " <ReflectMethod>"); !slices.Contains(marked, f) {
				marked = append(marked, f)
			}
		}
	}
	if len(marked) > 0 {
		t.Errorf("reachable functions call reflect's Method/MethodByName, so the linker keeps every exported method: %v", marked)
	}
}
