#!/usr/bin/env bash
# Builds etcd and the Kubernetes components from the Go module proxy into a cache outside the
# repo, keyed by version, and reuses what is already there. Prints progress: a cold build takes
# 10-15 minutes on 2 cores, a warm one seconds.
#
# Usage: build.sh            -> prints the bin directory on the last line of stdout
#        build.sh --check    -> same, but builds nothing: exits 2 when a binary is missing
#        build.sh e2e [--check] -> also Kubernetes' own e2e.test, agnhost and the ginkgo CLI (test/external-e2e;
#                              cold ~+25 min), same module and cache
# Env:   DIRPV_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/dirpv)
#        K8S_VERSION (default v1.37.2), ETCD_VERSION (default v3.6.16)
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-v1.37.2}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
CACHE=${DIRPV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dirpv}
BIN="$CACHE/k8s-$K8S_VERSION-etcd-$ETCD_VERSION/bin"
components=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
e2e=""
if [ "${1:-}" = "e2e" ]; then
  e2e=1
  shift
fi

log() { echo "build.sh: $*" >&2; }

missing=()
for c in "${components[@]}" etcd; do
  [ -x "$BIN/$c" ] || missing+=("$c")
done
if [ -n "$e2e" ]; then
  for c in e2e.test agnhost ginkgo; do
    [ -x "$BIN/$c" ] || missing+=("$c")
  done
fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "$BIN"
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  log "not built yet: ${missing[*]} (in $BIN)"
  exit 2
fi
mkdir -p "$BIN"

# The staging modules that k8s.io/kubernetes replaces with ./staging/...; each maps to v0.x.y.
staging=(api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
  cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
  cri-client cri-streaming csi-translation-lib dynamic-resource-allocation endpointslice externaljwt
  kms kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
  mount-utils pod-security-admission sample-apiserver streaming)
minor=${K8S_VERSION#v1.}
staging_version="v0.$minor"

k8s_src="$CACHE/src/k8s-$K8S_VERSION"
if [[ " ${missing[*]} " == *" kube"* || " ${missing[*]} " == *" e2e.test "* || " ${missing[*]} " == *" agnhost "* || " ${missing[*]} " == *" ginkgo "* ]]; then
  mkdir -p "$k8s_src"
  cd "$k8s_src"
  if [ ! -f go.sum ]; then
    log "resolving k8s.io/kubernetes $K8S_VERSION (module proxy)"
    {
      echo "module dirpv.local/k8sbuild"
      echo
      echo "go 1.26"
      echo
      echo "require k8s.io/kubernetes $K8S_VERSION"
      echo
      for s in "${staging[@]}"; do echo "replace k8s.io/$s => k8s.io/$s $staging_version"; done
    } > go.mod
    {
      echo "//go:build tools"
      echo
      echo "package tools"
      echo
      echo "import ("
      for c in "${components[@]}"; do echo "	_ \"k8s.io/kubernetes/cmd/$c\""; done
      echo ")"
    } > tools.go
    go mod tidy >&2
  fi
  # e2e.test is the test binary of k8s.io/kubernetes/test/e2e: tidy keeps go.sum entries only for
  # what the scratch module imports, so its test imports, agnhost and the ginkgo CLI (parallel
  # runs) go in a tools file of their own, re-tidied whenever that list changes.
  if [ -n "$e2e" ]; then
    {
      echo "//go:build tools"
      echo
      echo "package tools"
      echo
      echo "import ("
      echo "	_ \"github.com/onsi/ginkgo/v2/ginkgo\""
      echo "	_ \"k8s.io/kubernetes/test/images/agnhost\""
      go list -e -f '{{join .TestImports "\n"}}' k8s.io/kubernetes/test/e2e | grep '\.' | sed 's/.*/	_ "&"/'
      echo ")"
    } > tools_e2e.go.tmp
    if cmp -s tools_e2e.go.tmp tools_e2e.go; then
      rm tools_e2e.go.tmp
    else
      log "resolving k8s.io/kubernetes/test/e2e's test imports, agnhost and ginkgo (module proxy)"
      mv tools_e2e.go.tmp tools_e2e.go
      # A failed tidy (no network) must not leave the new list looking resolved: the next run
      # would skip the tidy and fail on go.sum.
      go mod tidy >&2 || { rm -f tools_e2e.go; exit 1; }
    fi
  fi
  major=1
  ldflags=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=${minor%%.*}"
    ldflags+=" -X $p.gitTreeState=clean"
  done
  for c in "${components[@]}"; do
    [ -x "$BIN/$c" ] && continue
    log "building $c $K8S_VERSION (cold: several minutes each)"
    start=$(date +%s)
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ldflags" -o "$BIN/$c.tmp" "k8s.io/kubernetes/cmd/$c" >&2
    mv "$BIN/$c.tmp" "$BIN/$c"
    log "built $c in $(( $(date +%s) - start ))s"
  done
  if [ -n "$e2e" ] && [ ! -x "$BIN/agnhost" ]; then
    log "building agnhost (static)"
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$BIN/agnhost.tmp" k8s.io/kubernetes/test/images/agnhost >&2
    mv "$BIN/agnhost.tmp" "$BIN/agnhost"
  fi
  if [ -n "$e2e" ] && [ ! -x "$BIN/ginkgo" ]; then
    log "building the ginkgo CLI (parallel e2e.test runs)"
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$BIN/ginkgo.tmp" github.com/onsi/ginkgo/v2/ginkgo >&2
    mv "$BIN/ginkgo.tmp" "$BIN/ginkgo"
  fi
  if [ -n "$e2e" ] && [ ! -x "$BIN/e2e.test" ]; then
    log "building e2e.test $K8S_VERSION (cold: 20 minutes or more)"
    start=$(date +%s)
    CGO_ENABLED=0 go test -c -trimpath -ldflags "-s -w $ldflags" -o "$BIN/e2e.test.tmp" k8s.io/kubernetes/test/e2e >&2
    mv "$BIN/e2e.test.tmp" "$BIN/e2e.test"
    log "built e2e.test in $(( $(date +%s) - start ))s"
  fi
fi

if [ ! -x "$BIN/etcd" ]; then
  etcd_src="$CACHE/src/etcd-$ETCD_VERSION"
  mkdir -p "$etcd_src"
  cd "$etcd_src"
  if [ ! -f go.sum ]; then
    log "resolving etcd $ETCD_VERSION"
    printf 'module dirpv.local/etcdbuild\n\ngo 1.26\n' > go.mod
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
  fi
  log "building etcd $ETCD_VERSION"
  CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$BIN/etcd.tmp" go.etcd.io/etcd/server/v3 >&2
  mv "$BIN/etcd.tmp" "$BIN/etcd"
fi
echo "$BIN"
