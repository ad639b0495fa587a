package volume

import (
	"reflect"
	"strings"
	"testing"
)

func TestSnapshotHandleRoundTrip(t *testing.T) {
	for _, h := range []SnapshotHandle{
		{Backend: BackendNFS, Server: "fd00::1", Share: "/srv/a&b=c?", MountOptions: []string{"nfsvers=4.1", "hard"}, Name: "snapshot-1", Size: 1 << 30},
		{Backend: BackendLocal, BasePath: "/var/lib/dirpv", Node: "node-a", Name: "snapshot-2", Size: 0},
	} {
		s := h.String()
		got, err := ParseSnapshotHandle(s)
		if err != nil {
			t.Fatalf("%s: %v", s, err)
		}
		if !reflect.DeepEqual(got, h) {
			t.Errorf("%s: got %+v, want %+v", s, got, h)
		}
	}
}

func TestSnapshotHandleRefused(t *testing.T) {
	good := SnapshotHandle{Backend: BackendLocal, BasePath: "/b", Node: "n", Name: "s", Size: 1}.String()
	for name, s := range map[string]string{
		"not dirpv's":     "local:pv-1",
		"unknown key":     good + "&secret=x",
		"repeated key":    good + "&name=t",
		"name with slash": strings.Replace(good, "name=s", "name=..%2Fx", 1),
		"dot dot":         strings.Replace(good, "name=s", "name=..", 1),
		"no node":         strings.Replace(good, "node=n", "node=", 1),
		"relative base":   strings.Replace(good, "basePath=%2Fb", "basePath=b", 1),
		"bad size":        strings.Replace(good, "size=1", "size=x", 1),
		"nfs no server":   SnapshotHandle{Backend: BackendNFS, Share: "/s", Name: "s"}.String(),
		"local options":   SnapshotHandle{Backend: BackendLocal, BasePath: "/b", Node: "n", Name: "s", MountOptions: []string{"ro"}}.String(),
	} {
		if _, err := ParseSnapshotHandle(s); err == nil {
			t.Errorf("%s: %s accepted", name, s)
		}
	}
}
