"""The simplest out-of-tree kpx backend: write the agent's node-local state to a JSON file.

    python3 json_file_plugin.py --output /var/run/kpx-state.json \
        [--target unix:///run/proxy-agent/state.sock]

Built only on kpx_localstate_client. The file is replaced atomically after each change.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from kpx_localstate_client import DEFAULT_TARGET, State, default_target, run


def as_json(state: State) -> dict[str, object]:
    """The state as JSON-ready data (proto field names, ports ordered by key)."""
    return {
        "instanceId": state.instance_id,
        "revision": state.revision,
        "node": MessageToDict(state.node, preserving_proto_field_name=True),
        "settings": MessageToDict(state.settings, preserving_proto_field_name=True),
        "servicePorts": [
            MessageToDict(state.service_ports[key], preserving_proto_field_name=True)
            for key in sorted(state.service_ports)
        ],
    }


def write_atomically(path: Path, data: dict[str, object]) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
        json.dump(data, out, indent=1, sort_keys=True)
    os.replace(out.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument(
        "--target", default=default_target(), help=f"default: $KPX_STATE_API, else {DEFAULT_TARGET}"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    run(lambda state: write_atomically(args.output, as_json(state)), args.target)


if __name__ == "__main__":
    main()
