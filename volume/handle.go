package volume

import "strings"

// Handle is the CSI volume handle of a dirpv PV: "<backend>:<PV name>", unique because PV
// names are, and stable for the PV's life.
func Handle(b Backend, pvName string) string { return string(b) + ":" + pvName }

// BackendLabel is b as a metrics label: "nfs", "local", or "unknown" for anything else, so
// that a hand-written PV or a bad class cannot grow a metric's label set.
func BackendLabel(b Backend) string {
	if b == BackendNFS || b == BackendLocal {
		return string(b)
	}
	return "unknown"
}

// HandleBackendLabel is BackendLabel of the backend a volume handle names, for calls such as
// NodeUnpublishVolume that carry the handle but no volume attributes.
func HandleBackendLabel(handle string) string {
	b, _, _ := strings.Cut(handle, ":")
	return BackendLabel(Backend(b))
}
