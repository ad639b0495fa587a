// Command release writes dirpv's release into a directory (make release: dist/) without a
// Docker engine or registry: the image as a linux/amd64 + linux/arm64 OCI index, the kind and
// NFS manifests pinned to its digest, the packaged Helm chart and SHA256SUMS. It prints the
// image's reference by digest on stdout.
//
//	go run ./test/release/cmd/release -version v0.2.0 -o dist -image-roots ~/.cache/dirpv/image-debs
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/dirpv/dirpv/test/release"
)

func main() {
	opts := release.Options{}
	flag.StringVar(&opts.Version, "version", "", "Release version (required): the image tag, the chart's appVersion, linked into dirpv.")
	flag.StringVar(&opts.Dir, "o", "dist", "Output directory, replaced whole.")
	flag.StringVar(&opts.ImageRoots, "image-roots", release.DefaultImageRoots(), "Debian's packages of each architecture unpacked in <arch>/root (make image-debs-<arch>).")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "release: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, opts); err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, opts release.Options) error {
	rel, err := release.BuildLocal(ctx, opts.Dir, opts.Version, opts.ImageRoots)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "release: %s in %s (image %s: amd64 %s, arm64 %s; chart %s)\n", rel.Version, rel.Dir,
		rel.Image.Name, rel.Image.Manifests["amd64"], rel.Image.Manifests["arm64"], rel.Chart)
	fmt.Println(rel.ImageRef)
	return nil
}
