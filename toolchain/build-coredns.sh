#!/usr/bin/env bash
# Builds the pinned CoreDNS (toolchain/coredns/go.mod) from its Go module into the same cache as
# the Kubernetes binaries, keyed by version: $PROXY_CACHE_DIR/bin/coredns-<version>/coredns. A
# binary already in the cache is not built again. The real-kubelet cluster's DNS runs it
# (harness/kpx_cluster/kubelets, docs/real-kubelets.md).
#
#   toolchain/build-coredns.sh
#
# Env: PROXY_CACHE_DIR (default ~/.cache/kpx) holds bin/coredns-<version>/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mod="$here/coredns"
version=$(awk '$1=="require" && $2=="github.com/coredns/coredns" {print $3; exit}' "$mod/go.mod")
[ -n "$version" ] || { echo "toolchain/coredns/go.mod does not require github.com/coredns/coredns" >&2; exit 1; }
cache=${PROXY_CACHE_DIR:-$HOME/.cache/kpx}
out="$cache/bin/coredns-$version"

if [ -x "$out/coredns" ]; then
  echo "cached: $out/coredns"
  exit 0
fi

cd "$mod"
mkdir -p "$out"
echo "building coredns $version (minutes on a small machine)..."
start=$(date +%s)
CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$out/coredns.tmp" \
  github.com/coredns/coredns
mv "$out/coredns.tmp" "$out/coredns"
echo "built coredns in $(( $(date +%s) - start ))s"
