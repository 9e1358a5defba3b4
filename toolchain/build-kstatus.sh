#!/usr/bin/env bash
# Builds the kstatus checker (toolchain/kstatus: sigs.k8s.io/cli-utils' status.Compute and
# Flux-style CEL health expressions on one object read from stdin) into the same cache as the
# Kubernetes binaries, keyed by the pinned cli-utils version:
# $PROXY_CACHE_DIR/bin/kstatus-<cli-utils version>/kstatus. A binary already in the cache is not
# built again. tests/e2e/test_gitops_status.py runs it.
#
#   toolchain/build-kstatus.sh
#
# Env: PROXY_CACHE_DIR (default ~/.cache/kpx) holds bin/kstatus-<version>/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mod="$here/kstatus"
version=$(awk '$1=="sigs.k8s.io/cli-utils" {print $2; exit} $1=="require" && $2=="sigs.k8s.io/cli-utils" {print $3; exit}' "$mod/go.mod")
[ -n "$version" ] || { echo "toolchain/kstatus/go.mod does not require sigs.k8s.io/cli-utils" >&2; exit 1; }
cache=${PROXY_CACHE_DIR:-$HOME/.cache/kpx}
out="$cache/bin/kstatus-$version"

if [ -x "$out/kstatus" ]; then
  echo "cached: $out/kstatus"
  exit 0
fi

cd "$mod"
mkdir -p "$out"
echo "building kstatus (cli-utils $version)..."
start=$(date +%s)
CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$out/kstatus.tmp" .
mv "$out/kstatus.tmp" "$out/kstatus"
echo "built kstatus in $(( $(date +%s) - start ))s"
