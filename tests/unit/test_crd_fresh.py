"""The committed CRD is what the models generate, and it is a valid structural schema."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_api import Mode, ProxyConfiguration, ProxyConfigurationSpec, crdgen
from kpx_api.structural import apply_defaults

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml"
EXAMPLES = sorted((REPO / "examples").glob("proxyconfig*.yaml"))

FORBIDDEN_KEYS = ("$ref", "allOf", "oneOf", "not", "definitions", "$defs", "uniqueItems")


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node below `node` (independent of kpx_api.structural.walk)."""
    yield path, node
    for name, prop in node.get("properties", {}).items():
        yield from nodes(prop, f"{path}.{name}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            yield from nodes(node[key], path + suffix)


def test_committed_crd_is_fresh() -> None:
    assert CRD_PATH.read_text() == crdgen.render(), (
        f"{CRD_PATH.relative_to(REPO)} is stale: run `make crds`"
    )


def test_check_mode_detects_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--check", str(tmp_path)]) == 0
    target = tmp_path / crdgen.FILE_NAME
    target.write_text(target.read_text().replace("default: 14", "default: 15"))
    assert crdgen.main(["--check", str(tmp_path)]) == 1
    assert "run `make crds`" in capsys.readouterr().err


def test_crd_names(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "proxyconfigurations.proxy.kpx.dev"
    assert spec["group"] == "proxy.kpx.dev"
    assert spec["scope"] == "Cluster"
    assert spec["names"] == {
        "kind": "ProxyConfiguration",
        "listKind": "ProxyConfigurationList",
        "plural": "proxyconfigurations",
        "singular": "proxyconfiguration",
        "shortNames": ["pxc"],
        "categories": ["kpx"],
    }
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Mode": ".spec.mode",
        "Ready": ".status.readyNodes",
        "Desired": ".status.desiredNodes",
        "Deprecated": ".status.deprecated",
        "Age": ".metadata.creationTimestamp",
    }


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    problems = []
    for path, node in nodes(schema):
        special = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        if "type" not in node and not special:
            problems.append(f"{path}: no type")
        problems += [f"{path}: {key}" for key in FORBIDDEN_KEYS if key in node]
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{path}: anyOf")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path}: properties and additionalProperties")
        if node.get("nullable"):
            problems.append(f"{path}: nullable")
    assert problems == []


def test_every_property_has_a_description(schema: dict[str, Any]) -> None:
    missing = [
        f"{path}.{name}"
        for path, node in nodes(schema)
        for name, prop in node.get("properties", {}).items()
        if not prop.get("description") and (path, name) != ("", "metadata")
    ]
    assert missing == []


def test_cel_cost_bounds(schema: dict[str, Any]) -> None:
    """Strings, lists and maps carry limits (the CEL cost budget and etcd need them)."""
    unbounded = []
    for path, node in nodes(schema):
        kind = node.get("type")
        if path in (".apiVersion", ".kind", ".metadata"):
            continue  # the apiserver's own fields
        if kind == "string" and not ({"maxLength", "enum", "format"} & node.keys()):
            unbounded.append(path)
        if kind == "array" and "maxItems" not in node:
            unbounded.append(path)
        if "additionalProperties" in node and "maxProperties" not in node:
            unbounded.append(path)
    assert unbounded == []


def test_every_rule_has_a_message(schema: dict[str, Any]) -> None:
    for path, node in nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["rule"] and rule["message"], path
            assert set(rule) <= {"rule", "message", "messageExpression", "fieldPath", "reason"}


def test_selected_mode_cel_rules_are_present(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    for mode in Mode:
        assert f"!has(self.{mode}) || self.mode == '{mode}'" in rules
    assert any("acknowledgeDeprecation" in r for r in rules)
    assert spec["required"] == ["mode"]
    assert "default" not in spec["properties"]["mode"]


def test_kopf_status_is_preserved(schema: dict[str, Any]) -> None:
    kopf = schema["properties"]["status"]["properties"]["kopf"]
    assert kopf["x-kubernetes-preserve-unknown-fields"] is True
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_crd_defaults_match_model_defaults(schema: dict[str, Any], path: Path) -> None:
    """What the apiserver stores for an example (CRD defaults) is what the models make of it."""
    data = yaml.safe_load(path.read_text())
    stored = apply_defaults(data, schema)
    assert stored["spec"] == ProxyConfiguration.model_validate(data).spec.to_dict()


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_crd_defaults_of_a_minimal_spec(schema: dict[str, Any], mode: str) -> None:
    stored = apply_defaults({"spec": {"mode": mode}}, schema)
    assert stored["spec"] == ProxyConfigurationSpec.model_validate({"mode": mode}).to_dict()


def test_committed_node_state_crd_is_fresh() -> None:
    """crds/proxynodestates.proxy.kpx.dev.yaml is what the ProxyNodeState models give, with
    the printer columns that answer mode, generation, agent version and last error."""
    path = REPO / "crds" / crdgen.NODE_STATE_FILE_NAME
    assert path.read_text() == crdgen.render_all()[crdgen.NODE_STATE_FILE_NAME], (
        "crds/ is stale: run `make crds`"
    )
    crd = yaml.safe_load(path.read_text())
    (version,) = crd["spec"]["versions"]
    assert crd["spec"]["scope"] == "Cluster" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Mode"] == ".status.mode"
    assert columns["Generation"] == ".status.configurationGeneration"
    assert columns["Agent"] == ".status.agentVersion"
    assert columns["Last-Error"] == ".status.lastError.message"
