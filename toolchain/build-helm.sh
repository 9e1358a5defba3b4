#!/usr/bin/env bash
# Builds the pinned Helm (toolchain/helm/go.mod) from its Go module into the same cache as the
# Kubernetes binaries, keyed by version: $PROXY_CACHE_DIR/bin/<helm version>/helm. A binary already
# in the cache is not built again. The chart's tests (tests/unit/test_chart.py) run this helm.
#
#   toolchain/build-helm.sh
#
# Env: PROXY_CACHE_DIR (default ~/.cache/kpx) holds bin/<version>/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mod="$here/helm"
version=$(awk '$1=="require" && $2=="helm.sh/helm/v3" {print $3; exit} $1=="helm.sh/helm/v3" {print $2; exit}' "$mod/go.mod")
[ -n "$version" ] || { echo "toolchain/helm/go.mod does not require helm.sh/helm/v3" >&2; exit 1; }
cache=${PROXY_CACHE_DIR:-$HOME/.cache/kpx}
out="$cache/bin/$version"

if [ -x "$out/helm" ]; then
  echo "cached: $out/helm"
  exit 0
fi

cd "$mod"
# As helm's own Makefile: the version, and the Kubernetes version `helm template` and `helm lint`
# assume without a cluster (client-go v0.X.Y -> 1.X; without these flags helm assumes 1.20).
client_go=$(go list -mod=readonly -m -f '{{.Version}}' k8s.io/client-go)
k8s_minor=${client_go#v0.}; k8s_minor=${k8s_minor%%.*}
ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$version"
ldflags="$ldflags -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done

mkdir -p "$out"
echo "building helm $version (a few minutes on a small machine)..."
start=$(date +%s)
CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "$ldflags" -o "$out/helm.tmp" \
  helm.sh/helm/v3/cmd/helm
mv "$out/helm.tmp" "$out/helm"
echo "built helm in $(( $(date +%s) - start ))s"
