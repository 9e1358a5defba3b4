#!/usr/bin/env bash
# Regenerates the Go code of the state API (localstatev1/) from the project's .proto
# (api/proto/kpx/localstate/v1/localstate.proto): protoc from grpcio-tools (the Python dev
# dependency that generates the Python client's code), protoc-gen-go and protoc-gen-go-grpc at the
# versions this module's go.mod pins (its `tool` lines), built from the Go module proxy.
#
#   examples/plugins/go-localstate/generate.sh          # rewrite localstatev1/*.pb.go
#   examples/plugins/go-localstate/generate.sh --check  # exit 1 when they are stale
#
# The .proto names no Go package: the import path is given here (M option), so the contract
# holds nothing specific to this example.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
proto=kpx/localstate/v1/localstate.proto
pkg=kpx.dev/examples/go-localstate/localstatev1

plugins=$(mktemp -d)
out=$(mktemp -d)
trap 'rm -rf "$plugins" "$out"' EXIT
cd "$here"
go build -mod=readonly -o "$plugins/" google.golang.org/protobuf/cmd/protoc-gen-go \
  google.golang.org/grpc/cmd/protoc-gen-go-grpc
python3 -m grpc_tools.protoc -I"$repo/api/proto" \
  --plugin=protoc-gen-go="$plugins/protoc-gen-go" --plugin=protoc-gen-go-grpc="$plugins/protoc-gen-go-grpc" \
  --go_out="$out" --go_opt=paths=source_relative --go_opt="M$proto=$pkg" \
  --go-grpc_out="$out" --go-grpc_opt=paths=source_relative --go-grpc_opt="M$proto=$pkg" \
  "$proto"
gen="$out/$(dirname "$proto")"
if [ "${1:-}" = "--check" ]; then
  stale=0
  for f in localstate.pb.go localstate_grpc.pb.go; do
    cmp -s "$gen/$f" "$here/localstatev1/$f" || { echo "stale: localstatev1/$f (run $0)"; stale=1; }
  done
  exit $stale
fi
mkdir -p "$here/localstatev1"
cp "$gen/localstate.pb.go" "$gen/localstate_grpc.pb.go" "$here/localstatev1/"
echo "wrote $here/localstatev1/localstate.pb.go, localstate_grpc.pb.go"
