package filelock

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"
)

// A second Lock waits while the first is held, gives up when its context ends, and gets the
// lock once the first is dropped.
func TestLockExcludesAndHonoursContext(t *testing.T) {
	path := filepath.Join(t.TempDir(), "lock")
	unlock, err := Lock(context.Background(), path, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := Lock(ctx, path, 10*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second Lock while held: %v, want the context's deadline", err)
	}
	unlock()
	again, err := Lock(context.Background(), path, 10*time.Millisecond)
	if err != nil {
		t.Fatalf("Lock after unlock: %v", err)
	}
	again()
}
