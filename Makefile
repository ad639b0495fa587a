# dirpv. `make up` runs it on a local cluster built from source; `make test` runs every tier.
# Everything a tier needs (Kubernetes binaries, apt packages, servers) is installed and started
# by the tier itself and stopped again.

GO          ?= go
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS     := -s -w -X github.com/dirpv/dirpv/internal/daemon.Version=$(VERSION)
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
# Checks .github/workflows (which run on GitHub, not here); built by go run and cached as staticcheck is.
ACTIONLINT  := github.com/rhysd/actionlint/cmd/actionlint@v1.7.12
# Unit, conformance, harness and manifest tests: no cluster needed.
UNIT_PKGS   := $(shell $(GO) list ./... | grep -v -e /test/integration -e /test/e2e -e /test/external-e2e -e /test/cluster -e /test/vm)
FUZZTIME    ?= 10m

.PHONY: all build test test-unit test-integration test-e2e test-vm conformance cluster-bins e2e-bins deploy-tools lint fmt up down bench fuzz image-tar release clean

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -tags grpcnotrace -ldflags '$(LDFLAGS)' -o bin/dirpv ./cmd/dirpv

## test: lint and the builds, then every tier in order: unit + csi-sanity, integration, end to
## end, real kernel, Kubernetes' External Storage suite. It bounds itself: everything ends within
## TEST_BUDGET minutes of its start (CI gives 90), each step within its own cap as well, so a hung
## tier fails alone and leaves the later ones their time. A tier's go test -timeout is its bound
## less a minute, so a hang inside a test ends with go test's goroutine dump rather than a kill.
TEST_BUDGET ?= 88
test:
	@start=$$(date +%s); deadline=$$((start + $(TEST_BUDGET) * 60)); rc=0; failed=; times=; \
	  step() { \
	    name=$$1; cap=$$2; shift 2; left=$$(( (deadline - $$(date +%s)) / 60 )); bound=$$(( cap < left ? cap : left )); \
	    if [ $$bound -lt 2 ]; then echo "make test: $$name not run: the $(TEST_BUDGET) min budget is spent"; rc=1; failed="$$failed $$name"; return; fi; \
	    t=$$(date +%s); \
	    timeout -k 30s $${bound}m $(MAKE) --no-print-directory TIER_TIMEOUT=$$((bound - 1))m "$$@" || { \
	      rc=1; failed="$$failed $$name"; \
	      if [ $$(( $$(date +%s) - t )) -ge $$((bound * 60)) ]; then echo "make test: $$name stopped at its bound of $$bound min"; fi; }; \
	    times="$$times $$name $$(( $$(date +%s) - t ))s,"; }; \
	  step builds 45 lint cluster-bins e2e-bins deploy-tools; \
	  step unit+sanity 25 test-unit; \
	  step integration 15 test-integration; \
	  step e2e 15 test-e2e; \
	  step vm 25 test-vm; \
	  step conformance 25 conformance; \
	  echo "tier times:$${times%,}; total $$(( $$(date +%s) - start ))s"; \
	  if [ $$rc -ne 0 ]; then echo "make test: failed:$$failed (see above)"; fi; exit $$rc

# A tier's go test -timeout: make test sets it from the tier's bound; alone, a tier gets 30m.
TIER_TIMEOUT ?= 30m

test-unit: deploy-tools
	$(GO) test -race -count=1 -timeout $(TIER_TIMEOUT) $(UNIT_PKGS)

test-integration: cluster-bins
	$(GO) test -count=1 -timeout $(TIER_TIMEOUT) ./test/integration/...

test-e2e: cluster-bins deploy-tools
	$(GO) test -count=1 -p 1 -timeout $(TIER_TIMEOUT) ./test/cluster/... ./test/e2e/...

## test-vm: the real-kernel tier alone (NFS through the kernel client and server) in a qemu VM
## booted with the host's root; the kernel and initramfs are cached (cold: package download,
## initramfs and first boot). Then a Kubernetes node in the VM (test/vm/node: kubelet, containerd
## and runc on the guest's kernel, the control plane on the host in the test's own network
## namespace, reached over a tap device). `make test` runs it too. A machine where the VM cannot
## start fails the tier with the reason (TestRun*: "the VM cannot start on this machine: ...").
## VM_RUN=regexp picks guest tests.
test-vm: e2e-bins
	@start=$$(date +%s); rc=0; \
	  DIRPV_VM_RUN='$(VM_RUN)' $(GO) test -count=1 -timeout $(TIER_TIMEOUT) -v ./test/vm/ || rc=1; t1=$$(date +%s); \
	  $(GO) test -count=1 -timeout $(TIER_TIMEOUT) -v ./test/vm/node/ || rc=1; \
	  echo "vm tier: $$(($$(date +%s)-start))s (kernel tests $$((t1-start))s, node in the VM $$(($$(date +%s)-t1))s)"; \
	  if [ $$rc -ne 0 ]; then echo "vm tier failed: see the FAIL lines above (a VM that cannot start says why)"; fi; exit $$rc

## conformance: Kubernetes' own External Storage e2e suite (e2e.test of k8s.io/kubernetes, same
## version as the cluster) against dirpv installed from deploy/, one run per driver file in
## test/external-e2e (root). Prints passed/failed/skipped per driver file; any failure fails it.
## e2e.test and agnhost are built into the cluster-bins cache on first use.
## CONFORMANCE_FOCUS=regexp runs a part of the suite.
CONFORMANCE_FOCUS ?= External.Storage
conformance: e2e-bins deploy-tools image-debs
	@start=$$(date +%s); rc=0; \
	  $(GO) test -count=1 -timeout $(TIER_TIMEOUT) -v -run TestExternalStorage ./test/external-e2e/ -args -focus='$(CONFORMANCE_FOCUS)' || rc=1; \
	  echo "conformance: $$(($$(date +%s)-start))s"; exit $$rc

## cluster-bins: build etcd and Kubernetes from the Go module proxy (cold ~15 min, cached).
cluster-bins:
	bash test/cluster/build.sh >/dev/null

## e2e-bins: cluster-bins and Kubernetes' e2e.test, agnhost and ginkgo (cached), which the VM node
## tier and the conformance tier run. Built here, before any tier: the VM node tier's tests run
## in a network namespace of their own, where the Go module proxy cannot be reached.
e2e-bins:
	bash test/cluster/build.sh e2e >/dev/null

## deploy-tools: pinned helm v3.22.0 + kustomize v5.8.2 from the Go module proxy, cached, and
## local-path-provisioner v0.0.30, which the e2e tier runs as the provisioner dirpv takes over
## from. Built after cluster-bins they share its compiled k8s.io packages: cold, about a minute.
deploy-tools:
	bash test/deploy/tools.sh all >/dev/null

## image-debs: the Debian packages whose files the image copies from the host (mount, mount.nfs, and
## netbase's /etc/protocols, without which mount.nfs cannot mount NFSv3).
## The tiers that build the image and `make up` install them; `make image-tar` alone refuses
## without them and says which to install.
IMAGE_DEBS := mount nfs-common netbase
.PHONY: image-debs
test-unit test-e2e test-vm up: image-debs
image-debs:
	@if [ ! -x /bin/mount ] || [ ! -x /bin/umount ] || [ ! -x /sbin/mount.nfs ] || [ ! -e /etc/netconfig ] || [ ! -e /etc/protocols ]; then \
	  apt-get -qq -oDPkg::Lock::Timeout=600 update && \
	  DEBIAN_FRONTEND=noninteractive apt-get -qq -oDPkg::Lock::Timeout=600 install -y --no-install-recommends $(IMAGE_DEBS); \
	fi

## image-debs-amd64, image-debs-arm64: the release image's mount tools, their libraries and data
## files for each architecture: Debian $(IMAGE_SUITE)'s packages (the Dockerfile's base; those of
## IMAGE_DEBS and the libraries they load) from deb.debian.org, whatever the host's distribution,
## downloaded with a private apt state and sources (the host's dpkg gets no foreign
## architecture) and unpacked into $(IMAGE_ROOTS)/<arch>/root, which test/image takes them
## from. Cached: done once per list.
IMAGE_SUITE := bookworm
IMAGE_ROOT_DEBS := mount nfs-common netbase libtirpc-common libc6 libmount1 libblkid1 libselinux1 \
  libpcre2-8-0 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
IMAGE_ROOTS := $(HOME)/.cache/dirpv/image-debs
DEBIAN_KEYRING := /usr/share/keyrings/debian-archive-keyring.gpg
.PHONY: image-debs-amd64 image-debs-arm64
test-unit test-e2e: image-debs-amd64 image-debs-arm64
image-debs-amd64 image-debs-arm64: image-debs-%:
	@c=$(IMAGE_ROOTS)/$*; if [ "$$(cat $$c/root/.debs 2>/dev/null)" != "$(IMAGE_SUITE) $(IMAGE_ROOT_DEBS)" ]; then \
	  set -e; rm -rf $$c; mkdir -p $$c/lists/partial $$c/cache/archives/partial $$c/debs $$c/root.tmp $$c/sources.d; \
	  if [ ! -e $(DEBIAN_KEYRING) ]; then apt-get -qq -oDPkg::Lock::Timeout=600 update && \
	    DEBIAN_FRONTEND=noninteractive apt-get -qq -oDPkg::Lock::Timeout=600 install -y --no-install-recommends debian-archive-keyring; fi; \
	  for s in "debian $(IMAGE_SUITE)" "debian $(IMAGE_SUITE)-updates" "debian-security $(IMAGE_SUITE)-security"; do \
	    set -- $$s; echo "deb [arch=$* signed-by=$(DEBIAN_KEYRING)] http://deb.debian.org/$$1 $$2 main"; done > $$c/sources.list; \
	  apt="apt-get -qq -o Dir::Etc::SourceList=$$c/sources.list -o Dir::Etc::SourceParts=$$c/sources.d \
	    -o Dir::State::Lists=$$c/lists -o Dir::Cache=$$c/cache -o APT::Architecture=$* -o APT::Architectures::=$* \
	    -o APT::Sandbox::User=root -o Debug::NoLocking=1"; \
	  $$apt update; (cd $$c/debs && $$apt download $(IMAGE_ROOT_DEBS)); \
	  [ $$(ls $$c/debs | wc -l) -eq $(words $(IMAGE_ROOT_DEBS)) ] || { echo "image-debs-$*: not every package downloaded: $$(ls $$c/debs)"; exit 1; }; \
	  for d in $$c/debs/*.deb; do dpkg-deb -x $$d $$c/root.tmp; done; \
	  echo "$(IMAGE_SUITE) $(IMAGE_ROOT_DEBS)" > $$c/root.tmp/.debs; mv $$c/root.tmp $$c/root; \
	  rm -rf $$c/lists $$c/cache $$c/debs $$c/sources.list $$c/sources.d; \
	fi

## quota-debs: btrfs-progs and e2fsprogs, for the tests and the bench that make btrfs (with
## quota) and ext4 file systems on loop devices (volume/quota/quotatest; losetup comes with
## `mount`, above).
QUOTA_DEBS := btrfs-progs e2fsprogs
.PHONY: quota-debs
test-unit test-integration test-e2e bench: quota-debs
quota-debs:
	@if ! command -v mkfs.btrfs >/dev/null || ! command -v btrfs >/dev/null || ! command -v mkfs.ext4 >/dev/null; then \
	  apt-get -qq -oDPkg::Lock::Timeout=600 update && \
	  DEBIAN_FRONTEND=noninteractive apt-get -qq -oDPkg::Lock::Timeout=600 install -y --no-install-recommends $(QUOTA_DEBS); \
	fi

## monitoring-tools: promtool from Debian's prometheus package, with which test/deploy checks and
## unit-tests the alerts in deploy/components/monitoring (TestRulesPromtool). Only promtool is
## taken out of the package, into ~/.cache/dirpv/tools: installing the package would also
## enable and start a Prometheus server on machines that run systemd.
PROMTOOL := $(HOME)/.cache/dirpv/tools/promtool
.PHONY: monitoring-tools
test-unit: monitoring-tools
monitoring-tools:
	@if [ ! -x $(PROMTOOL) ]; then \
	  d=$$(mktemp -d) && cd $$d && \
	  { apt-get download prometheus >/dev/null 2>&1 || { apt-get -qq -oDPkg::Lock::Timeout=600 update && apt-get download prometheus >/dev/null 2>&1; }; } && \
	  dpkg-deb -x prometheus_*.deb x && mkdir -p $$(dirname $(PROMTOOL)) && cp x/usr/bin/promtool $(PROMTOOL) && \
	  cd / && rm -rf $$d; \
	fi

## image-tar: the dirpv image as an OCI tar (no Docker engine needed): bin/dirpv-image.tar, named
## ghcr.io/dirpv/dirpv:$(VERSION) (git describe), never :latest.
image-tar:
	$(GO) run ./test/image/cmd/image-tar -version $(VERSION)

## release: the release into dist/, without a Docker engine: dirpv-image.oci.tar (an OCI layout
## holding the image index ghcr.io/dirpv/dirpv:$(VERSION), linux/amd64 and linux/arm64),
## dirpv-kind.yaml and dirpv-nfs.yaml (deploy/overlays rendered, the image pinned by the index's
## digest), the Helm chart packaged (dirpv-<version>.tgz) and SHA256SUMS. VERSION=v0.2.0 on a tag.
## Both images carry Debian's mount tools (image-debs-<arch>), not the host's, so that the release
## is the same whichever machine builds it.
release: deploy-tools image-debs-amd64 image-debs-arm64
	$(GO) run ./test/release/cmd/release -version $(VERSION) -o dist -image-roots $(IMAGE_ROOTS)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(STATICCHECK) ./...
	$(GO) run $(ACTIONLINT) -color=false

fmt:
	gofmt -w $$(git ls-files '*.go')

## up: a local cluster with a node, dirpv running and dirpv-local as the default class.
up: cluster-bins
	$(GO) run ./test/cluster/cmd/dirpv-cluster up --node
	$(GO) run ./test/up

down:
	$(GO) run ./test/cluster/cmd/dirpv-cluster down

## bench: dirpv against the binding ceiling on a real control plane (root; ~35 min), ending
## with its targets table (docs/performance.md); its NFS phase runs through the kernel NFS
## client and server of the VM node tier (test/vm/node TestBenchNFS, ~5 min of it), its copy
## phase's XFS reflink and NFSv4.2 clone rows in the VM too (test/vm/kernel TestBenchCopy).
## BENCH_N=500; BENCH_NODES: simulated cluster sizes.
BENCH_N ?= 500
BENCH_NODES ?= 10,50,100
bench: cluster-bins
	@mkdir -p bin
	$(GO) run ./test/bench -n $(BENCH_N) -nodes $(BENCH_NODES) -json bin/bench.json
	$(GO) test -run '^$$' -bench . -benchmem ./provisioner

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzPathStaysBeneathBase -fuzztime $(FUZZTIME) ./provisioner/

clean:
	rm -rf bin dist
