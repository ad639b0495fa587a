package daemon

import (
	"context"
	"errors"
	"testing"
)

// Both processes refuse to start on a kernel that lacks what volume operations need, with
// the probe's message, before they touch the API server or a socket.
func TestRefuseOldKernelAtStartup(t *testing.T) {
	tooOld := errors.New("kernel 5.4.0 is too old: dirpv needs Linux 5.8 or newer")
	orig := checkKernel
	checkKernel = func() error { return tooOld }
	t.Cleanup(func() { checkKernel = orig })
	for name, run := range map[string]func() error{
		"controller": func() error { return RunController(context.Background(), ControllerConfig{}) },
		"node":       func() error { return RunNode(context.Background(), NodeConfig{NodeName: "n"}) },
	} {
		if err := run(); !errors.Is(err, tooOld) {
			t.Errorf("%s started on an old kernel: %v", name, err)
		}
	}
}
