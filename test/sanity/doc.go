// Package sanity runs the CSI conformance suite (github.com/kubernetes-csi/csi-test/v5/pkg/sanity)
// in-process against dirpv's CSI node plugin, with real bind mounts on temp directories. All
// code is in _test.go files: the controller endpoint the suite needs to create volumes is test
// scaffolding, since dirpv itself has no CSI controller.
package sanity
