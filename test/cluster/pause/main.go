// Command pause is the pod sandbox ("infra") process for the test cluster's containerd: it only
// holds the pod's namespaces open. It is built statically from source because the machines this
// runs on cannot pull registry.k8s.io/pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	// As PID 1 of a pod with a shared PID namespace we also inherit orphans; reap them so they
	// do not pile up as zombies. SIGCHLD wakes us for that.
	children := make(chan os.Signal, 1)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-sigs:
			os.Exit(0)
		case <-children:
			for {
				var ws syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
