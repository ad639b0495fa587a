package main

import (
	"slices"
	"testing"

	mount "k8s.io/mount-utils"
)

func TestParseArgsMountUtilsArgv(t *testing.T) {
	// Exactly what mount-utils v0.37.2 runs for mount.New(helper).Mount(...):
	// the literal "mount" first, then MakeMountArgs.
	argv := append([]string{"mount"}, mount.MakeMountArgs("127.0.0.1:/export/sub", "/t", "nfs",
		[]string{"vers=3", "ro", "port=2049", "mountport=20048", "nolock"})...)
	a, err := parseArgs(argv)
	if err != nil {
		t.Fatal(err)
	}
	if a.host != "127.0.0.1" || a.path != "/export/sub" || a.target != "/t" || a.fstype != "nfs" ||
		!a.readOnly || a.port != 2049 || a.mountPort != 20048 ||
		!slices.Equal(a.options, []string{"vers=3", "ro", "port=2049", "mountport=20048", "nolock"}) {
		t.Errorf("parsed %+v", a)
	}
}

func TestParseArgsMountNFSArgv(t *testing.T) {
	a, err := parseArgs([]string{"[::1]:/export//x/", "/t", "-o", "hard,rw", "-v", "-oro"})
	if err != nil {
		t.Fatal(err)
	}
	if a.host != "::1" || a.path != "/export/x" || !a.readOnly || !slices.Equal(a.options, []string{"hard", "rw", "ro"}) {
		t.Errorf("parsed %+v", a)
	}
}

func TestParseArgsErrors(t *testing.T) {
	for _, argv := range [][]string{
		{"mount", "-t", "nfs", "/t"},                   // no source
		{"mount", "-t", "cifs", "h:/x", "/t"},          // wrong type
		{"mount", "-t", "nfs", "nohost", "/t"},         // no colon
		{"mount", "-t", "nfs", "h:rel", "/t"},          // relative path
		{"mount", "-o", "port=x", "h:/x", "/t"},        // bad port
		{"mount", "-t", "nfs", "h:/x", "/t", "-o"},     // dangling -o
		{"mount", "-t", "nfs", "h:/x", "/t", "/extra"}, // too many
	} {
		if a, err := parseArgs(argv); err == nil {
			t.Errorf("parseArgs(%q) = %+v; want an error", argv, a)
		}
	}
}
