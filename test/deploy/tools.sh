#!/usr/bin/env bash
# Builds the pinned helm and kustomize CLIs that render deploy/ from the Go module proxy into a
# cache outside the repo, keyed by version, and reuses what is already there. Each tool is built in
# its own scratch module so that neither lands in the project's go.mod (helm alone drags in most of
# k8s.io). A cold build takes minutes on 2 cores, a warm one prints the path at once.
#
# Usage: tools.sh helm|kustomize|local-path-provisioner  -> builds when missing, prints the binary's path
#        tools.sh --check NAME             -> builds nothing: prints the path, or exits 2 when missing
#        tools.sh all                      -> builds all three, prints their paths
# local-path-provisioner is not a deploy tool: the e2e tier runs it, as a neighbour dirpv
# takes over from (test/e2e/install/localpath_test.go).
# Env:   DIRPV_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/dirpv)
#        HELM_VERSION (default v3.22.0), KUSTOMIZE_VERSION (default v5.8.2: v5.8.3 needs Go 1.27),
#        LOCAL_PATH_VERSION (default v0.0.30)
#        K8S_VERSION (default v1.37.2): the cluster build (test/cluster/build.sh) whose module
#        versions the tools are raised to when it is there, see align
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.22.0}
KUSTOMIZE_VERSION=${KUSTOMIZE_VERSION:-v5.8.2}
LOCAL_PATH_VERSION=${LOCAL_PATH_VERSION:-v0.0.30}
K8S_VERSION=${K8S_VERSION:-v1.37.2}
CACHE=${DIRPV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dirpv}
# The Go toolchain on the machine is the one pinned by go.mod; never download another.
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}

log() { echo "tools.sh: $*" >&2; }

check=false
if [ "${1:-}" = "--check" ]; then
  check=true
  shift
fi

# align raises every module that the current scratch module shares with the cluster build's
# module (make test builds the cluster first) to the cluster build's version where that is newer,
# as one module holding both would. Go's build cache is keyed by module version, so the tool then
# links the k8s.io, gRPC and x/ packages the cluster build compiled instead of compiling them
# again: a cold helm build takes seconds instead of minutes. The cluster's versions go in as
# requirements and `go get` selects the newest required version of each (minimal version
# selection), so no version is lowered; MODULE, the tool's own, is left alone. Returns non-zero
# when there is no cluster build to align with, or when go get fails.
align() {
  local module=$1 pkg=$2 cluster="$CACHE/src/k8s-$K8S_VERSION"
  [ -f "$cluster/go.sum" ] || return 1
  local fmt='{{.Path}} {{if .Replace}}{{.Replace.Version}}{{else}}{{.Version}}{{end}}'
  local path ours theirs
  local require=()
  while read -r path ours theirs; do
    if [ "$path" != "$module" ] && [ -n "$theirs" ] && [ "$ours" != "$theirs" ]; then
      require+=("-require=$path@$theirs")
    fi
  done < <(join <(go list -m -f "$fmt" all | sort) <(cd "$cluster" && go list -m -f "$fmt" all | sort))
  [ ${#require[@]} -eq 0 ] && return 0
  go mod edit "${require[@]}" && go get "$pkg" >&2
}

# build NAME VERSION MODULE PACKAGE LDFLAGS (PACKAGE is a command of MODULE, the tool pinned at VERSION)
build() {
  local name=$1 version=$2 module=$3 pkg=$4 ldflags=$5
  local dir="$CACHE/tools/$name-$version"
  local bin="$dir/$name"
  if [ -x "$bin" ]; then
    echo "$bin"
    return 0
  fi
  if $check; then
    log "$name $version not built yet (run test/deploy/tools.sh $name)"
    return 2
  fi
  local src="$dir/src"
  mkdir -p "$src"
  # A concurrent `go test` and `make` may both get here; the lock makes the second wait and
  # then find the binary instead of racing on the same output file.
  exec {lock}>"$dir/.lock"
  flock "$lock"
  if [ -x "$bin" ]; then
    echo "$bin"
    return 0
  fi
  cd "$src"
  if [ ! -f go.sum ]; then
    log "resolving $pkg $version (module proxy)"
    printf 'module dirpv.local/%sbuild\n\ngo 1.26\n' "$name" > go.mod
    # Get the package, not the module: go.sum then covers every module the package imports.
    go get "$pkg@$version" >&2
  fi
  log "building $name $version (cold: a few minutes)"
  local start
  start=$(date +%s)
  cp go.mod go.mod.own
  cp go.sum go.sum.own
  if ! { align "$module" "$pkg@$version" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ldflags" -o "$bin.tmp" "$pkg" >&2; }; then
    # No cluster build to share, or a raised version the tool does not build with: its own.
    mv go.mod.own go.mod
    mv go.sum.own go.sum
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ldflags" -o "$bin.tmp" "$pkg" >&2
  fi
  rm -f go.mod.own go.sum.own
  mv "$bin.tmp" "$bin"
  log "built $name in $(( $(date +%s) - start ))s"
  exec {lock}>&-
  echo "$bin"
}

helm() {
  # Helm's release Makefile stamps the Kubernetes version that `helm template` assumes (else
  # v1.20, which fails the chart's kubeVersion); it is the minor of helm's client-go (v0.37).
  build helm "$HELM_VERSION" helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm \
    "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean
     -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=37"
}

kustomize() {
  build kustomize "$KUSTOMIZE_VERSION" sigs.k8s.io/kustomize/kustomize/v5 sigs.k8s.io/kustomize/kustomize/v5 \
    "-X sigs.k8s.io/kustomize/api/provenance.version=kustomize/$KUSTOMIZE_VERSION"
}

local_path_provisioner() {
  build local-path-provisioner "$LOCAL_PATH_VERSION" github.com/rancher/local-path-provisioner \
    github.com/rancher/local-path-provisioner "-X main.VERSION=$LOCAL_PATH_VERSION"
}

case "${1:-}" in
  helm) helm ;;
  kustomize) kustomize ;;
  local-path-provisioner) local_path_provisioner ;;
  all) helm && kustomize && local_path_provisioner ;;
  *) echo "usage: $0 [--check] helm|kustomize|local-path-provisioner|all" >&2; exit 2 ;;
esac
