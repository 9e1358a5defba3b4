"""What the API says about each mode matches what the agent runs: the modes the CRD and the chart
accept are the agent's backend registry (kpx_agent.backends.REGISTRY), each description of the
mode names every one of them, and no text users read says a mode has no backend (or not yet)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kpx_agent.backends import REGISTRY
from kpx_api import Mode, ProxyConfigurationSpec

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml"
SCHEMA = REPO / "charts" / "kpx" / "values.schema.json"
VALUES = REPO / "charts" / "kpx" / "values.yaml"

#: Phrases that would tell a user a mode the agent runs is missing.
MISSING = re.compile(
    r"no (kernel )?backend (in the kpx agent )?yet|not (yet )?implemented|has no \w+ backend|"
    r"no \w+ backend yet|coming soon",
    re.IGNORECASE,
)


def crd_mode() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["mode"])


def descriptions(node: Any) -> list[str]:
    """Every `description` in a schema."""
    if isinstance(node, dict):
        own = [node["description"]] if isinstance(node.get("description"), str) else []
        return own + [d for value in node.values() for d in descriptions(value)]
    if isinstance(node, list):
        return [d for value in node for d in descriptions(value)]
    return []


def test_every_mode_the_api_accepts_has_a_backend_in_the_agent() -> None:
    assert {str(m) for m in Mode} == set(REGISTRY)
    assert set(crd_mode()["enum"]) == set(REGISTRY)


def test_the_chart_schema_accepts_the_same_modes() -> None:
    schema = json.loads(SCHEMA.read_text())
    assert set(schema["definitions"]["crd.mode"]["enum"]) == set(REGISTRY)


def test_each_description_of_the_mode_names_every_mode_the_agent_runs() -> None:
    field = ProxyConfigurationSpec.model_fields["mode"].description or ""
    comment = VALUES.read_text().split("\n  mode: ", 1)[0].rsplit("agents:", 1)[1]
    for where, text in {
        "ProxyConfigurationSpec.mode": field,
        "crds/ spec.mode": crd_mode()["description"],
        "values.yaml agents.mode": comment,
    }.items():
        for mode in REGISTRY:
            assert re.search(rf"\b{mode}\b", text), f"{where} does not name mode {mode}"


def test_no_description_says_a_mode_is_missing() -> None:
    crd = yaml.safe_load(CRD.read_text())
    texts = {
        "crds/": descriptions(crd),
        "values.schema.json": descriptions(json.loads(SCHEMA.read_text())),
        "values.yaml": [VALUES.read_text()],
    }
    said = {where: [t for t in found if MISSING.search(t)] for where, found in texts.items()}
    assert not any(said.values()), f"texts saying a mode is missing: {said}"


def test_the_missing_pattern_catches_the_old_sentence() -> None:
    """The pattern above would have caught what proxysettings.py once said."""
    assert MISSING.search("The agent has no ipvs backend yet: the operator reports Degraded.")
    assert MISSING.search("mode ipvs has no backend in the kpx agent yet")
    assert not MISSING.search("ipvs (deprecated upstream: needs ipvs.acknowledgeDeprecation)")
