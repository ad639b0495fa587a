package main

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/dirpv/dirpv/test/framework"
)

// newClaim is a bench claim; node, if set, is where the scheduler would have placed its pod.
func newClaim(ns, name, class, node string) *v1.PersistentVolumeClaim {
	if node == "" {
		return framework.NewClaim(ns, name, class)
	}
	return framework.NewClaim(ns, name, class, framework.OnNode(node))
}

// claims is newClaim for the claims c-0000, c-0001, ... of a bulk run.
func claims(ns, class, node string) func(i int) *v1.PersistentVolumeClaim {
	return func(i int) *v1.PersistentVolumeClaim { return newClaim(ns, fmt.Sprintf("c-%04d", i), class, node) }
}

// createClass creates a StorageClass made with framework.NewClass.
func (b *bench) createClass(sc *storagev1.StorageClass) error {
	if _, err := b.client.StorageV1().StorageClasses().Create(b.ctx, sc, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create StorageClass %s: %w", sc.Name, err)
	}
	return nil
}
