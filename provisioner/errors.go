package provisioner

import (
	"errors"
	"io/fs"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/dirpv/dirpv/volume/local"
)

func isNotExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }

// isNodeLocalFailure reports whether a local provision failed because of this node's disk:
// full, over quota, read-only, or a base path that cannot be created or written. Such a
// failure says nothing about other nodes.
func isNodeLocalFailure(err error) bool {
	for _, target := range []error{local.ErrUnusable, unix.ENOSPC, unix.EDQUOT, unix.EROFS, unix.EACCES, unix.EPERM} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// invalidError is a refusal that no retry can fix until the user changes the claim or the
// class. It carries gRPC InvalidArgument, the code the lib's infeasible check looks for: the
// lib then records one ProvisioningFailed event and retries the claim only after its slow
// interval (RetryIntervalMax), instead of every few seconds. Error is the message alone, so
// the event reads as dirpv wrote it, without gRPC's "rpc error: code = ..." prefix.
type invalidError struct{ err error }

func (e *invalidError) Error() string { return e.err.Error() }
func (e *invalidError) Unwrap() error { return e.err }

// GRPCStatus makes status.FromError, and so the lib, see codes.InvalidArgument.
func (e *invalidError) GRPCStatus() *status.Status {
	return status.New(codes.InvalidArgument, e.err.Error())
}

// isInvalid reports whether err is a refusal marked by invalid.
func isInvalid(err error) bool {
	var e *invalidError
	return errors.As(err, &e)
}

// invalid marks err as permanent for this claim and class.
func invalid(err error) error {
	if err == nil {
		return nil
	}
	return &invalidError{err: err}
}
