#!/usr/bin/env bash
# Builds the pinned Kubernetes binaries from their Go modules (toolchain/kubernetes/go.mod) into a
# cache outside git, keyed by version. A binary already in the cache is not built again.
#
#   toolchain/build-kubernetes.sh [component ...]   (default: the control plane and kubectl)
#
# Env: PROXY_CACHE_DIR (default ~/.cache/kpx) holds bin/<version>/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mod="$here/kubernetes"
version=$(awk '$1=="k8s.io/kubernetes" {print $2; exit}' "$mod/go.mod")
cache=${PROXY_CACHE_DIR:-$HOME/.cache/kpx}
out="$cache/bin/$version"
components=("$@")
[ ${#components[@]} -gt 0 ] || components=(kube-apiserver kube-controller-manager kube-scheduler kubectl)

major=${version#v}; major=${major%%.*}
minor=${version#v*.}; minor=${minor%%.*}
ldflags="-s -w"
for kv in "gitVersion=$version" "gitMajor=$major" "gitMinor=$minor" \
          "gitTreeState=clean" "buildDate=1970-01-01T00:00:00Z"; do
  ldflags="$ldflags -X k8s.io/component-base/version.$kv -X k8s.io/client-go/pkg/version.$kv"
done

mkdir -p "$out"
cd "$mod"
for c in "${components[@]}"; do
  if [ -x "$out/$c" ]; then
    echo "cached: $out/$c"
    continue
  fi
  case "$c" in
    kubectl) pkg=k8s.io/kubernetes/cmd/kubectl ;;
    agnhost) pkg=k8s.io/kubernetes/test/images/agnhost ;;  # the e2e suite's test image
    e2e.test) pkg=k8s.io/kubernetes/test/e2e ;;  # the e2e suite itself (`make conformance`)
    ginkgo) pkg=github.com/onsi/ginkgo/v2/ginkgo ;;  # runs e2e.test's specs in parallel
    regression-issue-74839) pkg=k8s.io/kubernetes/test/images/regression-issue-74839 ;;  # a Conntrack spec's image
    *) pkg=k8s.io/kubernetes/cmd/$c ;;
  esac
  echo "building $c $version (this takes minutes on a small machine)..."
  start=$(date +%s)
  if [ "$c" = e2e.test ]; then
    CGO_ENABLED=0 go test -c -vet=off -mod=mod -ldflags "$ldflags" -o "$out/$c.tmp" "$pkg"
  else
    CGO_ENABLED=0 go build -mod=mod -ldflags "$ldflags" -o "$out/$c.tmp" "$pkg"
  fi
  mv "$out/$c.tmp" "$out/$c"
  echo "built $c in $(( $(date +%s) - start ))s"
done
