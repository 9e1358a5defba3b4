"""Keep the kpx chart in step with the generated CRD (crds/, itself generated from api/kpx_api).

    python3 charts/sync_from_crds.py            copy crds/*.yaml into charts/kpx/crds/ and rewrite
                                                the CRD-derived definitions of values.schema.json
    python3 charts/sync_from_crds.py --check    exit 1 when either is stale (tests do the same)

`make crds` runs it after regenerating crds/. The CRD is copied byte for byte. In
charts/kpx/values.schema.json every definition named `crd.*` is generated here from the CRD's
spec schema (the agents' values are the spec's fields); the rest of that file is written by hand.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "crds"
CHART = REPO / "charts" / "kpx"
SCHEMA = CHART / "values.schema.json"
CRD_NAME = "proxyconfigurations.proxy.kpx.dev.yaml"
MODES = ("nftables", "iptables", "ipvs", "external")
PREFIX = "crd."

#: OpenAPI keywords that mean the same in JSON Schema (draft 7) and are kept as they are.
KEPT = (
    "description",
    "type",
    "enum",
    "default",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "required",
    "format",
)


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """A CRD (structural OpenAPI v3) schema node as JSON Schema for Helm values.

    Objects with properties reject unknown keys (the apiserver would prune them silently);
    int-or-string becomes a type union; CEL rules and list/map markers are dropped (the
    apiserver still checks them when the release is applied).
    """
    out: dict[str, Any] = {k: node[k] for k in KEPT if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        out["additionalProperties"] = False
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        out["items"] = to_json_schema(node["items"])
    return out


def crd_spec_schema(crd_text: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_text)
    (version,) = crd["spec"]["versions"]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def definitions(crd_text: str) -> dict[str, Any]:
    """The generated definitions: `crd.mode`, one per mode's block, and `crd.common`."""
    spec = crd_spec_schema(crd_text)
    props = spec["properties"]
    defs: dict[str, Any] = {f"{PREFIX}mode": to_json_schema(props["mode"])}
    for mode in MODES:
        defs[f"{PREFIX}{mode}"] = to_json_schema(props[mode])
    common = {k: v for k, v in props.items() if k != "mode" and k not in MODES}
    defs[f"{PREFIX}common"] = to_json_schema(
        {
            "description": "The spec's fields shared by every mode (docs/api.md).",
            "type": "object",
            "properties": common,
        }
    )
    return defs


def render_schema(current: str, crd_text: str) -> str:
    """values.schema.json with its `crd.*` definitions regenerated, the rest kept."""
    schema = json.loads(current)
    kept = {k: v for k, v in schema.get("definitions", {}).items() if not k.startswith(PREFIX)}
    schema["definitions"] = {**kept, **definitions(crd_text)}
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def expected() -> dict[Path, str]:
    """What each chart file derived from crds/ should contain."""
    crd_text = (CRDS / CRD_NAME).read_text(encoding="utf-8")
    copies = {CHART / "crds" / f.name: f.read_text(encoding="utf-8")
              for f in sorted(CRDS.glob("*.yaml"))}  # fmt: skip
    return {
        **copies,
        SCHEMA: render_schema(SCHEMA.read_text(encoding="utf-8"), crd_text),
    }


def stale() -> dict[Path, str]:
    """The derived files that differ from what crds/ gives, with a unified diff of each."""
    out = {}
    for path, text in expected().items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=str(path.relative_to(REPO)),
                tofile="from crds/",
            )
            out[path] = "".join(diff)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="charts/sync_from_crds.py", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the chart is stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for path, diff in problems.items():
            sys.stdout.write(diff)
            print(f"{path.relative_to(REPO)} is stale: run `make crds`", file=sys.stderr)
        return 1 if problems else 0
    for path, text in expected().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
