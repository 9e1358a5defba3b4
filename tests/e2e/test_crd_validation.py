"""The ProxyConfiguration CRD against a real kube-apiserver: examples apply and get their
defaults, invalid objects are rejected naming the field, and the Python models agree."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import yaml

from kpx_api import ConfigError, ProxyConfiguration, ProxyConfigurationSpec, parse_spec

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "proxyconfigurations.proxy.kpx.dev.yaml"
EXAMPLES = sorted((REPO / "examples").glob("proxyconfig*.yaml"))
RUN = secrets.token_hex(3)
RUN_LABEL = "e2e.kpx.dev/run"


class Cluster(Protocol):
    """What this module needs of the `cluster` fixture."""

    kubeconfig: Path

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> Any: ...


@pytest.fixture(scope="module")
def api(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with the CRD installed and served; deletes this run's objects afterwards."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/proxyconfigurations.proxy.kpx.dev",
        "--timeout=60s",
    )
    try:
        yield cluster
    finally:
        cluster.kubectl(
            "delete",
            "proxyconfigurations",
            "-l",
            f"{RUN_LABEL}={RUN}",
            "--ignore-not-found",
            "--wait=false",
            check=False,
        )


def manifest(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyConfiguration",
        "metadata": {"name": name, "labels": {RUN_LABEL: RUN}},
        "spec": spec,
    }


def apply(api: Cluster, obj: dict[str, Any], check: bool = True) -> Any:
    return api.kubectl(
        "apply",
        "--server-side",
        "--validate=strict",
        "--field-manager=kpx-e2e",
        "-f",
        "-",
        input=json.dumps(obj),
        check=check,
    )


def get(api: Cluster, name: str) -> dict[str, Any]:
    result = api.kubectl("get", "proxyconfiguration", name, "-o", "json")
    return json.loads(result.stdout)


def delete(api: Cluster, name: str) -> None:
    api.kubectl("delete", "proxyconfiguration", name, "--ignore-not-found", "--wait=false")


# --- valid objects ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_applies_and_gets_model_defaults(api: Cluster, path: Path) -> None:
    example = yaml.safe_load(path.read_text())
    name = f"{example['metadata']['name']}-{RUN}"
    obj = manifest(name, example["spec"])
    apply(api, obj)
    try:
        stored = get(api, name)
        expected = ProxyConfiguration.model_validate(example).spec.to_dict()
        assert stored["spec"] == expected
    finally:
        delete(api, name)


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_minimal_spec_gets_model_defaults(api: Cluster, mode: str) -> None:
    name = f"minimal-{mode}-{RUN}"
    apply(api, manifest(name, {"mode": mode}))
    try:
        assert (
            get(api, name)["spec"]
            == ProxyConfigurationSpec.model_validate({"mode": mode}).to_dict()
        )
    finally:
        delete(api, name)


def test_agent_resources_default_to_the_measured_limit_and_an_empty_block_keeps_none(
    api: Cluster,
) -> None:
    name = f"resources-{RUN}"
    apply(api, manifest(name, {"mode": "nftables"}))
    try:
        assert get(api, name)["spec"]["resources"] == {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "384Mi"},
        }
    finally:
        delete(api, name)
    name = f"no-resources-{RUN}"
    apply(api, manifest(name, {"mode": "nftables", "resources": {}}))
    try:
        assert get(api, name)["spec"]["resources"] == {"requests": {}, "limits": {}}
    finally:
        delete(api, name)


# --- invalid objects --------------------------------------------------------------------------

NFT: dict[str, Any] = {"mode": "nftables"}
ACK: dict[str, Any] = {"acknowledgeDeprecation": True}

# (case id, spec, field path below spec that the apiserver's error names)
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("mode-enum", {"mode": "userspace"}, "mode"),
    (
        "external-ips-cidr",
        {**NFT, "externalIPs": {"allowedCIDRs": ["192.0.2.1"]}},
        "externalIPs.allowedCIDRs[0]",
    ),
    ("mode-missing", {"nftables": {}}, "mode"),
    ("unknown-field", {**NFT, "proxyMode": "x"}, "proxyMode"),
    ("unknown-nested", {**NFT, "nftables": {"masqBit": 1}}, "nftables.masqBit"),
    ("bit-high", {**NFT, "nftables": {"masqueradeBit": 32}}, "nftables.masqueradeBit"),
    ("bit-low", {**NFT, "nftables": {"masqueradeBit": -1}}, "nftables.masqueradeBit"),
    ("bit-type", {**NFT, "nftables": {"masqueradeBit": "14"}}, "nftables.masqueradeBit"),
    ("duration-word", {**NFT, "nftables": {"syncPeriod": "30 s"}}, "nftables.syncPeriod"),
    ("duration-neg", {**NFT, "nftables": {"minSyncPeriod": "-1s"}}, "nftables.minSyncPeriod"),
    (
        "duration-day",
        {**NFT, "conntrack": {"tcpEstablishedTimeout": "1d"}},
        "conntrack.tcpEstablishedTimeout",
    ),
    ("sync-zero", {"mode": "iptables", "iptables": {"syncPeriod": "0s"}}, "iptables.syncPeriod"),
    (
        "min-gt-sync",
        {**NFT, "nftables": {"syncPeriod": "1s", "minSyncPeriod": "2s"}},
        "nftables.minSyncPeriod",
    ),
    ("conntrack-neg", {**NFT, "conntrack": {"maxPerCore": -5}}, "conntrack.maxPerCore"),
    ("conntrack-type", {**NFT, "conntrack": {"min": "lots"}}, "conntrack.min"),
    ("cidr-prefix", {**NFT, "clusterCIDRs": ["10.0.0.0/33"]}, "clusterCIDRs[0]"),
    ("cidr-host-bits", {**NFT, "clusterCIDRs": ["10.0.0.1/8"]}, "clusterCIDRs[0]"),
    ("cidr-garbage", {**NFT, "clusterCIDRs": ["ten/8"]}, "clusterCIDRs[0]"),
    ("cidr-same-family", {**NFT, "clusterCIDRs": ["10.0.0.0/8", "10.1.0.0/16"]}, "clusterCIDRs"),
    (
        "cidr-too-many",
        {**NFT, "clusterCIDRs": ["10.0.0.0/8", "fd00::/64", "10.1.0.0/16"]},
        "clusterCIDRs",
    ),
    ("cidr-duplicate", {**NFT, "clusterCIDRs": ["10.0.0.0/8", "10.0.0.0/8"]}, "clusterCIDRs"),
    (
        "nodeport-mixed",
        {**NFT, "nodePortAddresses": ["primary", "10.0.0.0/8"]},
        "nodePortAddresses",
    ),
    ("nodeport-word", {**NFT, "nodePortAddresses": ["all"]}, "nodePortAddresses[0]"),
    ("ipvs-no-ack", {"mode": "ipvs"}, "ipvs.acknowledgeDeprecation"),
    (
        "ipvs-ack-false",
        {"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": False}},
        "ipvs.acknowledgeDeprecation",
    ),
    ("other-block", {**NFT, "iptables": {}}, "iptables"),
    ("other-block-ipvs", {"mode": "iptables", "ipvs": ACK}, "ipvs"),
    ("scheduler", {"mode": "ipvs", "ipvs": {**ACK, "scheduler": "random"}}, "ipvs.scheduler"),
    (
        "exclude-cidr",
        {"mode": "ipvs", "ipvs": {**ACK, "excludeCIDRs": ["10.0.0.0"]}},
        "ipvs.excludeCIDRs[0]",
    ),
    (
        "namespace-name",
        {**NFT, "namespaceOptOut": {"namespaces": ["Bad_NS"]}},
        "namespaceOptOut.namespaces[0]",
    ),
    (
        "namespace-dup",
        {**NFT, "namespaceOptOut": {"namespaces": ["a", "a"]}},
        "namespaceOptOut.namespaces",
    ),
    ("selector-empty", {**NFT, "namespaceOptOut": {"selector": {}}}, "namespaceOptOut.selector"),
    (
        "selector-operator",
        {
            **NFT,
            "namespaceOptOut": {
                "selector": {"matchExpressions": [{"key": "a", "operator": "Equals"}]}
            },
        },
        "namespaceOptOut.selector.matchExpressions[0].operator",
    ),
    (
        "selector-in-empty",
        {
            **NFT,
            "namespaceOptOut": {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
        },
        "namespaceOptOut.selector.matchExpressions[0].values",
    ),
    (
        "selector-key",
        {**NFT, "namespaceOptOut": {"selector": {"matchLabels": {"-bad": "x"}}}},
        "namespaceOptOut.selector.matchLabels",
    ),
    ("bind-no-port", {**NFT, "healthzBindAddress": "0.0.0.0"}, "healthzBindAddress"),
    ("bind-port-high", {**NFT, "metricsBindAddress": "127.0.0.1:70000"}, "metricsBindAddress"),
    ("bind-v4-brackets", {**NFT, "healthzBindAddress": "[10.0.0.1]:80"}, "healthzBindAddress"),
    ("bind-bad-ip", {**NFT, "healthzBindAddress": "300.0.0.1:80"}, "healthzBindAddress"),
    ("max-unavailable-zero", {**NFT, "maxUnavailable": 0}, "maxUnavailable"),
    ("max-unavailable-string", {**NFT, "maxUnavailable": "50"}, "maxUnavailable"),
    ("max-unavailable-percent", {**NFT, "maxUnavailable": "150%"}, "maxUnavailable"),
    (
        "detect-bridge-missing",
        {**NFT, "detectLocal": {"mode": "BridgeInterface"}},
        "detectLocal.bridgeInterface",
    ),
    (
        "detect-prefix-unused",
        {**NFT, "detectLocal": {"interfaceNamePrefix": "veth"}},
        "detectLocal.interfaceNamePrefix",
    ),
    (
        "toleration-operator",
        {**NFT, "tolerations": [{"key": "a", "operator": "Maybe"}]},
        "tolerations[0].operator",
    ),
    ("toleration-no-key", {**NFT, "tolerations": [{"value": "x"}]}, "tolerations[0].operator"),
    (
        "toleration-seconds",
        {**NFT, "tolerations": [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]},
        "tolerations[0].tolerationSeconds",
    ),
    ("node-selector-key", {**NFT, "nodeSelector": {"bad key": "x"}}, "nodeSelector"),
    ("quantity", {**NFT, "resources": {"requests": {"cpu": "lots"}}}, "resources.requests.cpu"),
    (
        "requests-over-limits",
        {**NFT, "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}},
        "resources.requests",
    ),
    ("priority-class", {**NFT, "priorityClassName": "Not_Valid"}, "priorityClassName"),
    ("image", {**NFT, "image": "has space"}, "image"),
]


@pytest.mark.parametrize(("spec", "field"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_object_is_rejected_naming_the_field(
    api: Cluster, request: pytest.FixtureRequest, spec: dict[str, Any], field: str
) -> None:
    case = request.node.callspec.id
    name = f"bad-{case}-{RUN}"
    result = apply(api, manifest(name, spec), check=False)
    if result.returncode == 0:
        delete(api, name)
    assert result.returncode != 0, f"the apiserver accepted {spec}"
    assert f"spec.{field}" in result.stderr, result.stderr

    # The Python models reject the same object, naming the same field.
    with pytest.raises(ConfigError) as info:
        parse_spec(spec)
    paths = [error.path for error in info.value.errors]
    assert any(path.startswith(field) for path in paths), (paths, field)


def test_enough_invalid_cases() -> None:
    assert len(INVALID) >= 20


# --- kubectl explain and get ------------------------------------------------------------------


def test_explain_shows_descriptions(api: Cluster) -> None:
    out = api.kubectl("explain", "proxyconfiguration.spec.ipvs").stdout
    text = " ".join(out.split())
    assert "Settings of mode ipvs" in text
    assert "acknowledgeDeprecation" in text
    assert "deprecated upstream" in text
    assert "scheduler" in text and "round robin" in text
    out = api.kubectl("explain", "proxyconfiguration.spec.ipvs.scheduler").stdout
    assert "maglev" in " ".join(out.split())


def test_printer_columns_and_status(api: Cluster) -> None:
    name = f"columns-{RUN}"
    apply(api, manifest(name, {"mode": "ipvs", "ipvs": ACK}))
    try:
        status = {
            "status": {
                "readyNodes": 2,
                "desiredNodes": 3,
                "deprecated": True,
                "mode": "ipvs",
                "kopf": {"progress": {"some-handler": {"retries": 1, "started": "x"}}},
            }
        }
        api.kubectl(
            "patch",
            "proxyconfiguration",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps(status),
        )
        out = api.kubectl("get", "proxyconfigurations", name).stdout
        header, row = out.splitlines()[:2]
        assert header.split() == ["NAME", "MODE", "READY", "DESIRED", "DEPRECATED", "AGE"]
        assert row.split()[:5] == [name, "ipvs", "2", "3", "true"]
        stored = get(api, name)["status"]
        assert stored["kopf"] == status["status"]["kopf"], "kopf's progress storage was pruned"
        # The short name and the category work too.
        assert name in api.kubectl("get", "pxc").stdout
        assert name in api.kubectl("get", "kpx").stdout
    finally:
        delete(api, name)
