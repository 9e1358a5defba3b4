"""Generate the Python code of the node-local state API from its .proto (grpcio-tools).

    python3 api/proto/generate.py          # rewrite the generated files
    python3 api/proto/generate.py --check  # exit 1 when they are stale

The generated modules live in the client distribution (agents/kpx_localstate_client), which
the agent's server imports too: one copy of the generated code. Only the message classes are
generated (the server and the client address the one method by name, with their own
serializers), so the generated code imports nothing but protobuf.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "api" / "proto"
PROTO = "kpx/localstate/v1/localstate.proto"
OUT_DIR = REPO / "agents" / "kpx_localstate_client"
GENERATED = ("localstate_pb2.py", "localstate_pb2.pyi")


def generate() -> dict[str, bytes]:
    """The generated files' names and contents (needs grpcio-tools, a dev dependency)."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}", PROTO]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with {rc}")
        out = Path(tmp) / Path(PROTO).parent
        return {name: (out / name).read_bytes() for name in GENERATED}


def stale() -> list[str]:
    """The generated files that differ from what the .proto generates."""
    return [
        name
        for name, content in generate().items()
        if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_bytes() != content
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stale")
    args = parser.parse_args()
    if args.check:
        names = stale()
        for name in names:
            print(f"stale: {OUT_DIR / name} (run python3 api/proto/generate.py)")
        return 1 if names else 0
    for name, content in generate().items():
        (OUT_DIR / name).write_bytes(content)
        print(f"wrote {OUT_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
