package provisioner

import "testing"

func TestBeneath(t *testing.T) {
	for _, tc := range []struct {
		root, dir, rel string
		ok             bool
	}{
		{"/srv/nfs", "/srv/nfs/ns-c-pvc-1", "ns-c-pvc-1", true},
		{"/srv/nfs", "/srv/nfs/ns/c", "ns/c", true},
		{"/srv/nfs", "/srv/nfs", "", false},
		{"/srv/nfs", "/srv/nfs/", "", false},
		{"/srv/nfs", "/srv/nfsx/a", "", false},
		{"/srv/nfs", "/srv/nfs/../etc", "", false},
		{"/srv/nfs", "/srv/nfs/a/./b", "", false},
		{"/srv/nfs", "/srv/nfs//a", "", false},
		{"/srv/nfs", "srv/nfs/a", "", false},
		{"/srv/nfs", "/etc", "", false},
		{"/", "/etc", "", false},
	} {
		rel, ok := beneath(tc.root, tc.dir)
		if rel != tc.rel || ok != tc.ok {
			t.Errorf("beneath(%q, %q) = %q, %t; want %q, %t", tc.root, tc.dir, rel, ok, tc.rel, tc.ok)
		}
	}
}
