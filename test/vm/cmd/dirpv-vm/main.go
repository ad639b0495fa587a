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
	if (sub == "run" || sub == "test") && len(args) == 0 || sub != "prepare" && sub != "run" && sub != "test" {
		usage()
	}
	img, err := vm.Prepare(ctx, os.Stderr)
	if err != nil {
		return 1, err
	}
	switch sub {
	case "run":
		return report(vm.Run(ctx, img, vm.Command{Args: args, BootTimeout: boot, Timeout: timeout, Output: os.Stdout}))
	case "test":
		return report(vm.RunTest(ctx, img, vm.GoTest{Package: args[0], Flags: args[1:], Timeout: timeout, BootTimeout: boot, Output: os.Stdout}))
	}
	fmt.Printf("kernel %s\ninitramfs %s\n", img.Kernel, img.Initramfs)
	return 0, nil
}

// report prints the guest's times and returns its exit status.
func report(res *vm.Result, err error) (int, error) {
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
