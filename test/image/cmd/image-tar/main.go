// Command image-tar builds the dirpv binary and writes an OCI image tar of
// ghcr.io/dirpv/dirpv:<tag> without a Docker engine or registry, mirroring the Dockerfile's
// runtime stage with the host's mount tools (it refuses when the host lacks one, naming the
// Debian package). It prints the tar's path on stdout and the image's name on stderr.
//
//	go run ./test/image/cmd/image-tar [-tag TAG] [-version VERSION] [-o bin/dirpv-image.tar]
//	ctr -n k8s.io images import bin/dirpv-image.tar     # or: kind load image-archive ...
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/dirpv/dirpv/test/image"
)

func main() {
	var opts image.DirpvOptions
	flag.StringVar(&opts.Tag, "tag", "", "Tag of "+image.DirpvRepository+". Default: the version.")
	flag.StringVar(&opts.Output, "o", "", "Output tar. Default: <module root>/bin/dirpv-image.tar.")
	flag.StringVar(&opts.Version, "version", "", "Version linked into the binary. Default: git describe --tags --always --dirty.")
	flag.StringVar(&opts.Binary, "binary", "", "Use this prebuilt static dirpv instead of building one.")
	flag.StringVar(&opts.ModuleDir, "module", "", "dirpv module root. Default: found with go env GOMOD.")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "image-tar: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	tarPath, name, err := image.WriteDirpvTar(ctx, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "image-tar:", err)
		os.Exit(1)
	}
	fmt.Fprintln(os.Stderr, "image-tar: wrote", name)
	fmt.Println(tarPath)
}
