// Command dirpv-vm prepares the test VM of package github.com/dirpv/dirpv/test/vm and runs
// commands in it:
//
//	go run ./test/vm/cmd/dirpv-vm prepare                   # fetch the kernel, build the initramfs
//	go run ./test/vm/cmd/dirpv-vm run [-timeout 10m] -- CMD [ARG...]
//	go run ./test/vm/cmd/dirpv-vm test [-timeout 10m] PKG [TESTFLAG...]
//
// run exits with the guest command's exit status; test builds PKG's test binary on the host
// (go test -c) and runs it in the guest with -test.v and the given test flags.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/dirpv/dirpv/test/vm"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	timeout := fs.Duration("timeout", vm.DefaultTimeout, "deadline of the guest command")
	boot := fs.Duration("boot-timeout", vm.DefaultBootTimeout, "deadline of the boot")
	_ = fs.Parse(os.Args[2:])
	code, err := run(ctx, os.Args[1], fs.Args(), *boot, *timeout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dirpv-vm:", err)
		if code == 0 {
			code = 1
		}
	}
	stop()
	os.Exit(code)
}

func run(ctx context.Context, sub string, args []string, boot, timeout time.Duration) (int, error) {
	img, err := vm.Prepare(ctx, os.Stderr)
	if err != nil {
		return 1, err
	}
	cmd := vm.Command{BootTimeout: boot, Timeout: timeout, Output: os.Stdout}
	switch sub {
	case "prepare":
		fmt.Printf("kernel %s\ninitramfs %s\n", img.Kernel, img.Initramfs)
		return 0, nil
	case "run":
		if len(args) == 0 {
			usage()
		}
		cmd.Args = args
	case "test":
		if len(args) == 0 {
			usage()
		}
		bin, cleanup, err := vm.BuildTest(ctx, args[0])
		if err != nil {
			return 1, err
		}
		defer cleanup()
		cmd.Args = append([]string{bin.Path, "-test.v", "-test.timeout", timeout.String()}, args[1:]...)
		cmd.Dir = bin.Dir
		cmd.Timeout = timeout + time.Minute // the binary's own timeout reports first
	default:
		usage()
	}
	res, err := vm.Run(ctx, img, cmd)
	if err != nil {
		return 1, err
	}
	fmt.Fprintf(os.Stderr, "dirpv-vm: boot %s, command %s, exit status %d\n",
		res.Boot.Round(time.Second), res.Run.Round(time.Second), res.ExitCode)
	return res.ExitCode, nil
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: dirpv-vm prepare | run [-timeout D] -- CMD [ARG...] | test [-timeout D] PKG [TESTFLAG...]")
	os.Exit(2)
}
