// Command release writes dirpv's release into a directory (make release: dist/) without a
// Docker engine or registry: the image as a linux/amd64 + linux/arm64 OCI index, the kind and
// NFS manifests pinned to its digest, the packaged Helm chart and SHA256SUMS. It prints the
// image's reference by digest on stdout.
//
//	go run ./test/release/cmd/release -version v0.2.0 -o dist -arm64-root ~/.cache/dirpv/image-debs/arm64/root
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
	flag.StringVar(&opts.Arm64Root, "arm64-root", "", "Debian's arm64 packages unpacked (make image-debs-arm64). Default: its cache.")
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
	if opts.Arm64Root == "" {
		opts.Arm64Root = release.DefaultArm64Root()
	}
	rel, err := release.BuildLocal(ctx, opts.Dir, opts.Version, opts.Arm64Root)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "release: %s in %s (image %s: amd64 %s, arm64 %s; chart %s)\n", rel.Version, rel.Dir,
		rel.Image.Name, rel.Image.Manifests["amd64"], rel.Image.Manifests["arm64"], rel.Chart)
	fmt.Println(rel.ImageRef)
	return nil
}
