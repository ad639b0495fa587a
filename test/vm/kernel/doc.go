// Package kernel holds the tests that run inside the test VM of package vm, against the
// guest's real kernel: the NFS client through mount.nfs and the kernel NFS server. Its test
// binary fails on the host; the host-side test in package vm (make test-vm) builds it, runs it
// in the guest and reports its result.
package kernel
