#!/usr/bin/env bash
# Builds the Go example client of the state API (examples/plugins/go-localstate) with the
# machine's Go into the cache, keyed by a hash of its sources (go.mod, go.sum, *.go):
# $PROXY_CACHE_DIR/bin/go-localstate-<hash>/go-localstate. A binary already in the cache is not
# built again; prints its path on the last line. tests/e2e/test_state_api_go_client.py runs it.
#
#   toolchain/build-go-localstate.sh
#
# Env: PROXY_CACHE_DIR (default ~/.cache/kpx) holds bin/go-localstate-<hash>/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mod="$here/../examples/plugins/go-localstate"
cd "$mod"
hash=$(find . -name '*.go' -o -name go.mod -o -name go.sum | LC_ALL=C sort | xargs sha256sum \
  | sha256sum | cut -c1-12)
cache=${PROXY_CACHE_DIR:-$HOME/.cache/kpx}
out="$cache/bin/go-localstate-$hash"

if [ -x "$out/go-localstate" ]; then
  echo "cached: $out/go-localstate"
  exit 0
fi

mkdir -p "$out"
echo "building go-localstate ($hash)..."
start=$(date +%s)
CGO_ENABLED=0 go build -mod=readonly -trimpath -ldflags "-s -w" -o "$out/go-localstate.tmp" .
mv "$out/go-localstate.tmp" "$out/go-localstate"
echo "built go-localstate in $(( $(date +%s) - start ))s"
echo "built: $out/go-localstate"
