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
from google.protobuf.message import Message

from kpx_localstate_client import DEFAULT_TARGET, State, default_target, run


def _dict(message: Message) -> dict[str, object]:
    """Proto field names, every field written (false and empty ones too: an endpoint's
    `ready: false` says something)."""
    return MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def as_json(state: State) -> dict[str, object]:
    """The state as JSON-ready data (ports ordered by key, node facts by family)."""
    return {
        "instanceId": state.instance_id,
        "revision": state.revision,
        "node": _dict(state.node),
        "settings": _dict(state.settings),
        "nodeFacts": [_dict(state.node_facts[family]) for family in sorted(state.node_facts)],
        "servicePorts": [_dict(state.service_ports[key]) for key in sorted(state.service_ports)],
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
