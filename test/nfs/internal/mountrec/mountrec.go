// Package mountrec defines the record the test-only nfs-fuse-mount helper
// writes for each live mount, so that tests can prove which options (for
// example a StorageClass's mountOptions) reached the mount. FUSE cannot carry
// NFS options such as vers= or nolock in its own mount options (the kernel
// rejects unknown ones), hence a side file.
package mountrec

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Dir holds one JSON record (and the daemon's log) per mounted target.
const Dir = "/run/dirpv-nfs-fuse"

// Record describes one mount made by the helper.
type Record struct {
	Source   string    `json:"source"`   // as given, e.g. "127.0.0.1:/export/sub"
	Target   string    `json:"target"`   // cleaned absolute mount point
	FSType   string    `json:"fstype"`   // the -t argument, e.g. "nfs"
	Options  []string  `json:"options"`  // every -o option, in order, as given
	ReadOnly bool      `json:"readOnly"` // whether "ro" was honoured
	Server   string    `json:"server"`
	NFSAddr  string    `json:"nfsAddr"`   // host:port the daemon talks NFSv3 to
	MountArg string    `json:"mountPath"` // the path that was MNT'd on the server
	PID      int       `json:"pid"`       // the serving daemon
	Mounted  time.Time `json:"mounted"`
}

func key(target string) string {
	abs, err := filepath.Abs(target)
	if err != nil {
		abs = target
	}
	sum := sha256.Sum256([]byte(filepath.Clean(abs)))
	return hex.EncodeToString(sum[:8])
}

// Path is the record file for target.
func Path(target string) string { return filepath.Join(Dir, key(target)+".json") }

// LogPath is the daemon log for target.
func LogPath(target string) string { return filepath.Join(Dir, key(target)+".log") }

// Write stores r atomically (rename), so readers never see half a record.
func Write(r *Record) error {
	if err := os.MkdirAll(Dir, 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", Dir, err)
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding mount record: %w", err)
	}
	p := Path(r.Target)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("writing mount record: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		return fmt.Errorf("writing mount record: %w", err)
	}
	return nil
}

// Read loads the record for target.
func Read(target string) (*Record, error) {
	b, err := os.ReadFile(Path(target))
	if err != nil {
		return nil, fmt.Errorf("reading nfs-fuse-mount record for %s: %w", target, err)
	}
	var r Record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("decoding nfs-fuse-mount record for %s: %w", target, err)
	}
	return &r, nil
}
