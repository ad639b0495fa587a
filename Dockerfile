# syntax=docker/dockerfile:1
# dirpv: one image for both `dirpv controller` and `dirpv node`.
#
#   V=$(git describe --tags --always --dirty)
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     --build-arg VERSION=$V -t ghcr.io/dirpv/dirpv:$V .
#
# Tag with the version, never latest: deploy/ names the release's tag (deploy/README.md).
#
# Without a Docker engine (tests, kind): `go run ./test/image/cmd/image-tar` writes an OCI tar
# with the same binary (same build flags) and the same mount tools, taken from the host;
# `make release` writes both platforms' images that way, their tools from Debian bookworm's packages.

ARG GO_VERSION=1.26

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION}-bookworm AS build
ARG TARGETOS
ARG TARGETARCH
ARG VERSION=dev
WORKDIR /src
# Dependencies first, so that a source change does not download them again.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# Static (CGO_ENABLED=0) so the runtime image needs no libc for dirpv itself; cross-compiled on
# the build platform for each target platform. Keep these flags in step with the Makefile's
# `build` target and test/image/cmd/image-tar (grpcnotrace: test/image DirpvTags says why).
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH \
    go build -trimpath -tags grpcnotrace \
      -ldflags "-s -w -X github.com/dirpv/dirpv/internal/daemon.Version=${VERSION}" \
      -o /out/dirpv ./cmd/dirpv

FROM debian:bookworm-slim
# mount/umount (util-linux) do every bind mount of local volumes (dirpv calls mount(8) with
# --no-canonicalize); nfs-common brings mount.nfs for the NFS backend (controller and node),
# and netbase its /etc/protocols, without which every NFSv3 mount fails with "Protocol not
# supported" (nfs-common does not depend on it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends mount nfs-common netbase \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/dirpv /usr/local/bin/dirpv
# No USER: the image runs as root on purpose. The controller mounts NFS exports, which needs
# CAP_SYS_ADMIN in the host's user namespace (NFS cannot be mounted from a user namespace), and
# creates/chowns/removes directories of any owner; the node plugin bind-mounts into kubelet's
# pod directories. deploy/ drops every capability the controller does not need and makes only
# the node plugin privileged.
ENTRYPOINT ["/usr/local/bin/dirpv"]
