// Package sanity runs the CSI conformance suite (github.com/kubernetes-csi/csi-test/v5/pkg/sanity)
// in-process against dirpv's CSI node plugin with real mounts. TestSanity runs it on the host
// with local volumes (bind mounts on temp directories); Run is for other places that have
// something the host lacks, such as the test VM's kernel NFS export (test/vm/kernel). The
// controller endpoint the suite needs to create volumes is test scaffolding, since dirpv itself
// has no CSI controller: nothing outside tests imports this package.
package sanity
