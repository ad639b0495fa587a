package volume

import "testing"

func TestHandleNamesItsBackend(t *testing.T) {
	for _, tc := range []struct{ handle, want string }{
		{Handle(BackendNFS, "pvc-1"), "nfs"},
		{Handle(BackendLocal, "pvc-2"), "local"},
		{"pvc-3", "unknown"},
		{"hostile-" + string(make([]byte, 300)) + ":x", "unknown"},
		{"", "unknown"},
	} {
		if got := HandleBackendLabel(tc.handle); got != tc.want {
			t.Errorf("HandleBackendLabel(%.20q) = %q, want %q", tc.handle, got, tc.want)
		}
	}
}
