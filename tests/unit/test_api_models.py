"""Unit tests of the ProxyConfiguration models: defaults, round trips, validators, durations and
the agent's configuration file."""

from __future__ import annotations

import copy
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpx_api import (
    AgentConfiguration,
    ConfigError,
    IPTablesSettings,
    IPVSSettings,
    LabelSelector,
    Mode,
    NamespaceOptOut,
    NFTablesSettings,
    ProxyConfiguration,
    ProxyConfigurationSpec,
    ProxyConfigurationStatus,
    agent_config_from_spec,
    dump_agent_config,
    format_duration,
    ip_family,
    load_agent_config,
    parse_agent_config,
    parse_bind_address,
    parse_cidr,
    parse_duration,
    parse_quantity,
    parse_spec,
)
from kpx_api.scheduling import resolve_int_or_percent

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("proxyconfig*.yaml"))

DEFAULT_SPEC: dict[str, Any] = {
    "mode": "nftables",
    "conntrack": {
        "maxPerCore": 32768,
        "min": 131072,
        "tcpEstablishedTimeout": "24h",
        "tcpCloseWaitTimeout": "1h",
        "tcpBeLiberal": False,
        "udpTimeout": "0s",
        "udpStreamTimeout": "0s",
    },
    "clusterCIDRs": [],
    "nodePortAddresses": [],
    "detectLocal": {"mode": "ClusterCIDR"},
    "externalIPs": {"allowedCIDRs": []},
    "healthzBindAddress": "0.0.0.0:10256",
    "metricsBindAddress": "127.0.0.1:10249",
    "namespaceOptOut": {
        "namespaces": [],
        "selector": {
            "matchLabels": {"networking.k8s.io/kube-proxy": "disabled"},
            "matchExpressions": [],
        },
    },
    "stateAPI": {"enabled": False, "address": "unix:///run/proxy-agent/state.sock"},
    "takeover": {"fromKubeProxy": False, "moveKubeProxyOff": False},
    "nodeSelector": {},
    "tolerations": [],
    "priorityClassName": "system-node-critical",
    # The agent's measured peak at 10,000 Services (a relist included) with 50 % headroom.
    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "384Mi"}},
    # No image: the operator's (its release's agent) unless the spec sets one.
    "maxUnavailable": 1,
    "modeSwitch": {"acceptDropped": [], "progressDeadlineSeconds": 30, "rollbackOnFailure": True},
    "deletionPolicy": "Orphan",  # the safe default: deleting leaves the agents running
}


def spec_errors(spec: dict[str, Any]) -> list[str]:
    """The `path: message` lines of an invalid spec."""
    with pytest.raises(ConfigError) as info:
        parse_spec(spec)
    return [str(error) for error in info.value.errors]


# --- defaults ---------------------------------------------------------------------------------


def test_spec_defaults() -> None:
    assert ProxyConfigurationSpec(mode=Mode.NFTABLES).to_dict() == DEFAULT_SPEC


def test_resources_left_out_get_the_measured_default_and_an_empty_block_sets_none() -> None:
    assert parse_spec({"mode": "nftables"}).resources.limits == {"memory": "384Mi"}
    explicit = parse_spec({"mode": "nftables", "resources": {}}).resources
    assert (explicit.requests, explicit.limits) == ({}, {})
    only_requests = parse_spec({"mode": "nftables", "resources": {"requests": {"cpu": "1"}}})
    assert only_requests.resources.limits == {}


def test_mode_is_required() -> None:
    assert spec_errors({}) == ["mode: required field is missing"]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (
            "nftables",
            {
                "masqueradeBit": 14,
                "masqueradeAll": False,
                "localhostNodePorts": False,
                "syncPeriod": "30s",
                "minSyncPeriod": "1s",
            },
        ),
        (
            "iptables",
            {
                "masqueradeBit": 14,
                "masqueradeAll": False,
                "localhostNodePorts": True,
                "syncPeriod": "30s",
                "minSyncPeriod": "1s",
            },
        ),
        (
            "ipvs",
            {
                "acknowledgeDeprecation": False,
                "masqueradeBit": 14,
                "masqueradeAll": False,
                "scheduler": "rr",
                "syncPeriod": "30s",
                "minSyncPeriod": "0s",
                "strictARP": False,
                "excludeCIDRs": [],
                "tcpTimeout": "0s",
                "tcpFinTimeout": "0s",
                "udpTimeout": "0s",
            },
        ),
    ],
)
def test_mode_block_defaults(mode: str, expected: dict[str, Any]) -> None:
    extra = {"ipvs": {"acknowledgeDeprecation": True}} if mode == "ipvs" else {}
    spec = parse_spec({"mode": mode, **extra})
    settings = spec.mode_settings().to_dict()
    if mode == "ipvs":
        expected = {**expected, "acknowledgeDeprecation": True}
    assert settings == expected


def test_absent_block_is_not_invented() -> None:
    spec = parse_spec({"mode": "iptables"})
    assert spec.iptables is None
    assert isinstance(spec.mode_settings(), IPTablesSettings)
    assert "iptables" not in spec.to_dict()


def test_python_names_and_api_names_both_validate() -> None:
    by_name = NFTablesSettings(masquerade_bit=3, sync_period="1m")
    by_alias = NFTablesSettings.model_validate({"masqueradeBit": 3, "syncPeriod": "1m"})
    assert by_name == by_alias
    assert by_name.to_dict()["masqueradeBit"] == 3


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_round_trip(path: Path) -> None:
    data = yaml.safe_load(path.read_text())
    obj = ProxyConfiguration.model_validate(data)
    again = ProxyConfiguration.model_validate_json(obj.model_dump_json())
    assert again == obj
    assert ProxyConfiguration.model_validate(obj.to_dict()) == obj
    # What the user wrote survives unchanged; only defaults are added.
    for key, value in data["spec"].items():
        if not isinstance(value, dict):
            assert obj.spec.to_dict()[key] == value, key


def test_examples_cover_every_mode() -> None:
    modes = {yaml.safe_load(p.read_text())["spec"]["mode"] for p in EXAMPLES}
    names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in EXAMPLES}
    assert modes == {"nftables", "iptables", "ipvs", "external"}
    assert names == {"default", "iptables-pool", "ipvs-pool", "external"}


def test_status_round_trip_keeps_kopf_and_formats_times() -> None:
    data = {
        "observedGeneration": 3,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "AgentsReady",
                "message": "3/3 nodes ready",
                "lastTransitionTime": "2024-05-01T10:00:00.123456+02:00",
            }
        ],
        "mode": "ipvs",
        "desiredNodes": 3,
        "readyNodes": 3,
        "deprecated": True,
        "kopf": {"progress": {"handler": {"retries": 1, "anything": ["goes"]}}},
    }
    status = ProxyConfigurationStatus.model_validate(data)
    out = status.to_dict()
    assert out["conditions"][0]["lastTransitionTime"] == "2024-05-01T08:00:00Z"
    assert out["kopf"] == data["kopf"]
    assert status.condition("Ready") is not None
    assert status.condition("Degraded") is None
    assert ProxyConfigurationStatus.model_validate(out).to_dict() == out


def test_condition_time_needs_a_zone() -> None:
    with pytest.raises(ValueError, match="time zone"):
        ProxyConfigurationStatus.model_validate(
            {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "X",
                        "lastTransitionTime": "2024-05-01T10:00:00",
                    }
                ]
            }
        )


# --- validators -------------------------------------------------------------------------------

NFT = {"mode": "nftables"}
IPVS_OK = {"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": True}}

# (id, spec, path of the error, words of its message)
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "mode-enum",
        {"mode": "userspace"},
        "mode",
        "must be one of 'nftables', 'iptables', 'ipvs' or 'external'",
    ),
    ("unknown-field", {**NFT, "proxyMode": "x"}, "proxyMode", "unknown field"),
    ("unknown-nested", {**NFT, "nftables": {"masqBit": 1}}, "nftables.masqBit", "unknown field"),
    ("bit-high", {**NFT, "nftables": {"masqueradeBit": 40}}, "nftables.masqueradeBit", "<= 31"),
    ("bit-low", {**NFT, "nftables": {"masqueradeBit": -1}}, "nftables.masqueradeBit", ">= 0"),
    (
        "bit-string",
        {**NFT, "nftables": {"masqueradeBit": "14"}},
        "nftables.masqueradeBit",
        "integer",
    ),
    (
        "bool-string",
        {**NFT, "nftables": {"masqueradeAll": "yes"}},
        "nftables.masqueradeAll",
        "boolean",
    ),
    (
        "duration-word",
        {**NFT, "nftables": {"syncPeriod": "30 s"}},
        "nftables.syncPeriod",
        "duration",
    ),
    (
        "duration-neg",
        {**NFT, "nftables": {"minSyncPeriod": "-1s"}},
        "nftables.minSyncPeriod",
        "duration",
    ),
    (
        "duration-bare",
        {**NFT, "conntrack": {"udpTimeout": "30"}},
        "conntrack.udpTimeout",
        "duration",
    ),
    (
        "duration-day",
        {**NFT, "conntrack": {"tcpEstablishedTimeout": "1d"}},
        "conntrack.tcpEstablishedTimeout",
        "duration",
    ),
    (
        "duration-huge",
        {**NFT, "conntrack": {"udpTimeout": "9999999h"}},
        "conntrack.udpTimeout",
        "2562047h",
    ),
    (
        "sync-zero",
        {"mode": "iptables", "iptables": {"syncPeriod": "0s"}},
        "iptables.syncPeriod",
        "greater than 0",
    ),
    (
        "min-gt-sync",
        {**NFT, "nftables": {"syncPeriod": "1s", "minSyncPeriod": "2s"}},
        "nftables.minSyncPeriod",
        "not be greater than syncPeriod",
    ),
    ("conntrack-neg", {**NFT, "conntrack": {"maxPerCore": -5}}, "conntrack.maxPerCore", ">= 0"),
    ("conntrack-min-type", {**NFT, "conntrack": {"min": "lots"}}, "conntrack.min", "integer"),
    ("cidr-prefix", {**NFT, "clusterCIDRs": ["10.0.0.0/33"]}, "clusterCIDRs[0]", "CIDR"),
    ("cidr-host-bits", {**NFT, "clusterCIDRs": ["10.0.0.1/8"]}, "clusterCIDRs[0]", "no bits set"),
    ("cidr-no-prefix", {**NFT, "clusterCIDRs": ["10.0.0.0"]}, "clusterCIDRs[0]", "CIDR"),
    ("cidr-leading-zero", {**NFT, "clusterCIDRs": ["010.0.0.0/8"]}, "clusterCIDRs[0]", "CIDR"),
    ("cidr-mapped", {**NFT, "clusterCIDRs": ["::ffff:10.0.0.0/104"]}, "clusterCIDRs[0]", "CIDR"),
    (
        "cidr-same-family",
        {**NFT, "clusterCIDRs": ["10.0.0.0/8", "10.1.0.0/16"]},
        "clusterCIDRs",
        "one CIDR per IP family",
    ),
    (
        "cidr-too-many",
        {**NFT, "clusterCIDRs": ["10.0.0.0/8", "fd00::/64", "10.1.0.0/16"]},
        "clusterCIDRs",
        "at most 2",
    ),
    (
        "cidr-duplicate",
        {**NFT, "clusterCIDRs": ["10.0.0.0/8", "10.0.0.0/8"]},
        "clusterCIDRs[1]",
        "duplicate",
    ),
    (
        "nodeport-primary-mixed",
        {**NFT, "nodePortAddresses": ["primary", "10.0.0.0/8"]},
        "nodePortAddresses",
        '"primary" must be the only value',
    ),
    (
        "nodeport-word",
        {**NFT, "nodePortAddresses": ["all"]},
        "nodePortAddresses[0]",
        '"primary" or a CIDR',
    ),
    (
        "ipvs-no-ack",
        {"mode": "ipvs"},
        "ipvs.acknowledgeDeprecation",
        "mode ipvs is deprecated upstream",
    ),
    (
        "ipvs-ack-false",
        {"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": False}},
        "ipvs.acknowledgeDeprecation",
        "set spec.ipvs.acknowledgeDeprecation: true",
    ),
    (
        "other-block",
        {**NFT, "iptables": {}},
        "iptables",
        "spec.iptables is set but spec.mode is nftables",
    ),
    (
        "other-block-ipvs",
        {"mode": "iptables", "ipvs": {"acknowledgeDeprecation": True}},
        "ipvs",
        "spec.ipvs is set but spec.mode is iptables",
    ),
    (
        "scheduler",
        {"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": True, "scheduler": "random"}},
        "ipvs.scheduler",
        "must be one of",
    ),
    (
        "exclude-cidr",
        {"mode": "ipvs", "ipvs": {"acknowledgeDeprecation": True, "excludeCIDRs": ["x"]}},
        "ipvs.excludeCIDRs[0]",
        "CIDR",
    ),
    (
        "external-ips-cidr",
        {**NFT, "externalIPs": {"allowedCIDRs": ["192.0.2.1"]}},
        "externalIPs.allowedCIDRs[0]",
        "CIDR",
    ),
    (
        "namespace-name",
        {**NFT, "namespaceOptOut": {"namespaces": ["Bad_NS"]}},
        "namespaceOptOut.namespaces[0]",
        "DNS-1123 label",
    ),
    (
        "namespace-long",
        {**NFT, "namespaceOptOut": {"namespaces": ["a" * 64]}},
        "namespaceOptOut.namespaces[0]",
        "at most 63",
    ),
    (
        "namespace-dup",
        {**NFT, "namespaceOptOut": {"namespaces": ["a", "a"]}},
        "namespaceOptOut.namespaces[1]",
        'duplicate value "a"',
    ),
    (
        "selector-empty",
        {**NFT, "namespaceOptOut": {"selector": {}}},
        "namespaceOptOut.selector",
        "must not be empty",
    ),
    (
        "selector-operator",
        {
            **NFT,
            "namespaceOptOut": {
                "selector": {"matchExpressions": [{"key": "a", "operator": "Equals"}]}
            },
        },
        "namespaceOptOut.selector.matchExpressions[0].operator",
        "must be one of",
    ),
    (
        "selector-in-empty",
        {
            **NFT,
            "namespaceOptOut": {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
        },
        "namespaceOptOut.selector.matchExpressions[0].values",
        "must not be empty",
    ),
    (
        "selector-exists-values",
        {
            **NFT,
            "namespaceOptOut": {
                "selector": {
                    "matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]
                }
            },
        },
        "namespaceOptOut.selector.matchExpressions[0].values",
        "must be empty",
    ),
    (
        "selector-key",
        {**NFT, "namespaceOptOut": {"selector": {"matchLabels": {"-bad": "x"}}}},
        "namespaceOptOut.selector.matchLabels",
        "'-bad' is invalid",
    ),
    (
        "selector-value",
        {**NFT, "namespaceOptOut": {"selector": {"matchLabels": {"a": "-bad"}}}},
        "namespaceOptOut.selector.matchLabels.a",
        "label value",
    ),
    ("bind-no-port", {**NFT, "healthzBindAddress": "0.0.0.0"}, "healthzBindAddress", "IP:port"),
    (
        "bind-port-high",
        {**NFT, "metricsBindAddress": "127.0.0.1:70000"},
        "metricsBindAddress",
        "port must be from 1 to 65535",
    ),
    (
        "bind-port-zero",
        {**NFT, "metricsBindAddress": "127.0.0.1:0"},
        "metricsBindAddress",
        "port must be from 1 to 65535",
    ),
    ("bind-v6-bare", {**NFT, "healthzBindAddress": "::1:10256"}, "healthzBindAddress", "IP:port"),
    (
        "bind-v4-brackets",
        {**NFT, "healthzBindAddress": "[10.0.0.1]:80"},
        "healthzBindAddress",
        "IPv6 address in brackets",
    ),
    (
        "bind-bad-ip",
        {**NFT, "healthzBindAddress": "300.0.0.1:80"},
        "healthzBindAddress",
        "IPv4 address",
    ),
    (
        "bind-hostname",
        {**NFT, "healthzBindAddress": "localhost:80"},
        "healthzBindAddress",
        "IP:port",
    ),
    ("max-unavailable-zero", {**NFT, "maxUnavailable": 0}, "maxUnavailable", "positive integer"),
    (
        "max-unavailable-number-string",
        {**NFT, "maxUnavailable": "50"},
        "maxUnavailable",
        "percentage",
    ),
    ("max-unavailable-percent", {**NFT, "maxUnavailable": "150%"}, "maxUnavailable", "percentage"),
    ("max-unavailable-bool", {**NFT, "maxUnavailable": True}, "maxUnavailable", "positive integer"),
    (
        "detect-bridge-missing",
        {**NFT, "detectLocal": {"mode": "BridgeInterface"}},
        "detectLocal.bridgeInterface",
        "required when mode is BridgeInterface",
    ),
    (
        "detect-prefix-missing",
        {**NFT, "detectLocal": {"mode": "InterfaceNamePrefix"}},
        "detectLocal.interfaceNamePrefix",
        "required",
    ),
    (
        "detect-prefix-unused",
        {**NFT, "detectLocal": {"interfaceNamePrefix": "veth"}},
        "detectLocal.interfaceNamePrefix",
        "only used when mode is InterfaceNamePrefix",
    ),
    (
        "detect-mode",
        {**NFT, "detectLocal": {"mode": "PodCIDR"}},
        "detectLocal.mode",
        "must be one of",
    ),
    (
        "detect-iface-long",
        {**NFT, "detectLocal": {"mode": "BridgeInterface", "bridgeInterface": "a" * 16}},
        "detectLocal.bridgeInterface",
        "at most 15",
    ),
    (
        "toleration-operator",
        {**NFT, "tolerations": [{"key": "a", "operator": "Maybe"}]},
        "tolerations[0].operator",
        "must be one of",
    ),
    (
        "toleration-no-key",
        {**NFT, "tolerations": [{"value": "x"}]},
        "tolerations[0].operator",
        "must be Exists when key is empty",
    ),
    (
        "toleration-exists-value",
        {**NFT, "tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]},
        "tolerations[0].value",
        "must be empty",
    ),
    (
        "toleration-seconds",
        {**NFT, "tolerations": [{"key": "a", "effect": "NoSchedule", "tolerationSeconds": 5}]},
        "tolerations[0].tolerationSeconds",
        "NoExecute",
    ),
    (
        "toleration-effect",
        {**NFT, "tolerations": [{"key": "a", "effect": "Never"}]},
        "tolerations[0].effect",
        "must be one of",
    ),
    (
        "node-selector-key",
        {**NFT, "nodeSelector": {"bad key": "x"}},
        "nodeSelector",
        "'bad key' is invalid",
    ),
    (
        "quantity",
        {**NFT, "resources": {"requests": {"cpu": "lots"}}},
        "resources.requests.cpu",
        "quantity",
    ),
    (
        "quantity-negative",
        {**NFT, "resources": {"limits": {"memory": "-1Gi"}}},
        "resources.limits.memory",
        "quantity",
    ),
    (
        "requests-over-limits",
        {**NFT, "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}},
        "resources.requests",
        "must not exceed limits.cpu",
    ),
    (
        "resource-name",
        {**NFT, "resources": {"requests": {"c p u": "1"}}},
        "resources.requests",
        "resource name 'c p u'",
    ),
    (
        "priority-class",
        {**NFT, "priorityClassName": "Not_Valid"},
        "priorityClassName",
        "DNS-1123 subdomain",
    ),
    ("image", {**NFT, "image": "has space"}, "image", "image reference"),
    ("image-empty", {**NFT, "image": ""}, "image", "must not be empty"),
    ("deletion-policy", {**NFT, "deletionPolicy": "Delete"}, "deletionPolicy", "Orphan"),
]


@pytest.mark.parametrize(
    ("spec", "path", "words"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_specs(spec: dict[str, Any], path: str, words: str) -> None:
    errors = spec_errors(spec)
    assert any(e.startswith(f"{path}: ") and words in e for e in errors), errors


VALID: list[tuple[str, dict[str, Any]]] = [
    ("dual-stack", {**NFT, "clusterCIDRs": ["10.244.0.0/16", "fd00:10:244::/56"]}),
    ("v6-only", {**NFT, "clusterCIDRs": ["fd00::/8"]}),
    ("nodeport-cidrs", {**NFT, "nodePortAddresses": ["10.0.0.0/8", "fd00::/64"]}),
    ("external-ips", {**NFT, "externalIPs": {"allowedCIDRs": ["192.0.2.0/24", "2001:db8::/64"]}}),
    ("bind-v6", {**NFT, "healthzBindAddress": "[::]:10256", "metricsBindAddress": "[fd00::1]:1"}),
    ("percent", {**NFT, "maxUnavailable": "100%"}),
    ("int", {**NFT, "maxUnavailable": 5}),
    ("durations", {**NFT, "nftables": {"syncPeriod": "1h30m", "minSyncPeriod": "1.5s"}}),
    ("micro", {**NFT, "conntrack": {"udpTimeout": "10µs", "udpStreamTimeout": "10us"}}),
    ("min-equals-sync", {**NFT, "nftables": {"syncPeriod": "5s", "minSyncPeriod": "5000ms"}}),
    ("tolerate-all", {**NFT, "tolerations": [{"operator": "Exists"}]}),
    (
        "toleration-noexecute",
        {**NFT, "tolerations": [{"key": "a", "effect": "NoExecute", "tolerationSeconds": 0}]},
    ),
    (
        "expressions-only",
        {
            **NFT,
            "namespaceOptOut": {
                "selector": {
                    "matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]
                }
            },
        },
    ),
    ("bridge", {**NFT, "detectLocal": {"mode": "BridgeInterface", "bridgeInterface": "cbr0"}}),
    (
        "requests-equal-limits",
        {**NFT, "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1024Mi"}}},
    ),
    (
        "ipvs",
        {
            **IPVS_OK,
            "ipvs": {
                "acknowledgeDeprecation": True,
                "scheduler": "mh",
                "excludeCIDRs": ["10.0.0.0/8"],
            },
        },
    ),
]


@pytest.mark.parametrize("spec", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_specs(spec: dict[str, Any]) -> None:
    parsed = parse_spec(spec)
    assert parse_spec(parsed.to_dict()) == parsed


def test_error_message_format() -> None:
    with pytest.raises(ConfigError) as info:
        parse_spec({**NFT, "nftables": {"masqueradeBit": 40}})
    assert str(info.value) == "spec: nftables.masqueradeBit: must be <= 31 (got 40)"


def test_every_bad_field_is_reported() -> None:
    errors = spec_errors(
        {**NFT, "nftables": {"masqueradeBit": 40}, "image": "a b", "conntrack": {"min": -1}}
    )
    assert [e.split(":")[0] for e in errors] == ["nftables.masqueradeBit", "conntrack.min", "image"]


def test_input_is_not_modified() -> None:
    spec = {**NFT, "nftables": {"masqueradeBit": 3}}
    before = copy.deepcopy(spec)
    parse_spec(spec)
    assert spec == before


# --- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0s", 0.0),
        ("30s", 30.0),
        ("1m30s", 90.0),
        ("1h", 3600.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("10us", 1e-5),
        ("10µs", 1e-5),
        ("100ns", 1e-7),
        ("2h45m30.5s", 9930.5),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "0", "30", "-1s", "1d", "1 s", "s", "1.s", ".5s", "1h 30m", "1S"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (30, "30s"), (90, "1m30s"), (3600, "1h"), (0.5, "500ms"), (5400.5, "1h30m0.5s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_cidr_helpers() -> None:
    assert ip_family("10.0.0.0/8") == 4
    assert ip_family("fd00::/64") == 6
    assert str(parse_cidr("10.244.0.0/16")) == "10.244.0.0/16"
    with pytest.raises(ValueError):
        parse_cidr("10.244.0.1/16")


def test_bind_address_helper() -> None:
    assert parse_bind_address("0.0.0.0:10256") == ("0.0.0.0", 10256)
    assert parse_bind_address("[::1]:10249") == ("::1", 10249)
    with pytest.raises(ValueError):
        parse_bind_address("[::1]:0")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", "1"),
        ("100m", "0.1"),
        ("128Mi", str(128 * 2**20)),
        ("1G", "1e9"),
        ("2e3", "2000"),
        ("1.5", "1.5"),
    ],
)
def test_parse_quantity(text: str, value: str) -> None:
    assert parse_quantity(text) == Decimal(value)


def test_resolve_int_or_percent() -> None:
    assert resolve_int_or_percent(3, 10) == 3
    assert resolve_int_or_percent("25%", 10) == 3
    assert resolve_int_or_percent("1%", 10) == 1


def test_selector_matching_and_query() -> None:
    selector = LabelSelector.model_validate(
        {
            "matchLabels": {"a": "1"},
            "matchExpressions": [
                {"key": "b", "operator": "In", "values": ["x", "y"]},
                {"key": "c", "operator": "NotIn", "values": ["z"]},
                {"key": "d", "operator": "Exists"},
                {"key": "e", "operator": "DoesNotExist"},
            ],
        }
    )
    assert selector.matches({"a": "1", "b": "x", "d": ""})
    assert selector.matches({"a": "1", "b": "y", "c": "q", "d": "v"})
    assert not selector.matches({"a": "1", "b": "x", "c": "z", "d": ""})
    assert not selector.matches({"a": "1", "b": "x", "d": "", "e": ""})
    assert not selector.matches({"a": "2", "b": "x", "d": ""})
    assert selector.as_query() == "a=1,b in (x,y),c notin (z),d,!e"


def test_namespace_opt_out_defaults() -> None:
    opt_out = NamespaceOptOut()
    assert opt_out.opts_out("any", {"networking.k8s.io/kube-proxy": "disabled"})
    assert not opt_out.opts_out("any", {})
    assert NamespaceOptOut(namespaces=["legacy"]).opts_out("legacy", {})


# --- agent configuration ----------------------------------------------------------------------


def test_agent_config_from_spec_fills_the_selected_block() -> None:
    spec = parse_spec({**NFT, "clusterCIDRs": ["10.0.0.0/8"], "nodeSelector": {"a": "b"}})
    config = agent_config_from_spec(spec)
    data = config.to_dict()
    assert list(data)[:3] == ["apiVersion", "kind", "mode"]
    assert data["apiVersion"] == "proxy.kpx.dev/v1alpha1"
    assert data["kind"] == "AgentConfiguration"
    assert data["nftables"] == NFTablesSettings().to_dict()
    assert "iptables" not in data and "ipvs" not in data
    assert data["clusterCIDRs"] == ["10.0.0.0/8"]
    for placement in ("nodeSelector", "tolerations", "image", "resources", "maxUnavailable"):
        assert placement not in data


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_agent_config_dump_and_load(path: Path, tmp_path: Path) -> None:
    spec = ProxyConfiguration.model_validate(yaml.safe_load(path.read_text())).spec
    config = agent_config_from_spec(spec)
    target = tmp_path / "config.yaml"
    target.write_text(dump_agent_config(config))
    loaded = load_agent_config(target)
    assert loaded == config
    assert loaded.mode_settings() == spec.mode_settings()


def test_load_agent_config_names_the_bad_field(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    config = AgentConfiguration.defaults_for(Mode.NFTABLES).to_dict()
    config["nftables"]["masqueradeBit"] = 40
    config["conntrack"]["tcpCloseWaitTimeout"] = "forever"
    config["iptables"] = {}
    target.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as info:
        load_agent_config(target)
    lines = str(info.value).splitlines()
    assert lines[0] == f"{target}: nftables.masqueradeBit: must be <= 31 (got 40)"
    assert lines[1].startswith(f"{target}: conntrack.tcpCloseWaitTimeout: must be a duration")
    assert lines[1].endswith('(got "forever")')


def test_load_agent_config_cross_field_rule(tmp_path: Path) -> None:
    target = tmp_path / "config.yaml"
    target.write_text(
        "apiVersion: proxy.kpx.dev/v1alpha1\nkind: AgentConfiguration\n"
        "mode: nftables\niptables: {}\n"
    )
    with pytest.raises(
        ConfigError, match=r"config.yaml: iptables: spec.iptables is set but spec.mode is nftables"
    ):
        load_agent_config(target)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("mode: [", "not valid YAML"),
        ("- a\n- b\n", "must be a mapping"),
        ("kind: KubeProxyConfiguration\nmode: nftables\n", "kind: must be 'AgentConfiguration'"),
        ("apiVersion: v1\nmode: nftables\n", "apiVersion: must be 'proxy.kpx.dev/v1alpha1'"),
        ("mode: nftables\nimage: x\n", "image: unknown field"),
        ("{}\n", "mode: required field is missing"),
    ],
)
def test_load_agent_config_rejects(tmp_path: Path, text: str, words: str) -> None:
    target = tmp_path / "config.yaml"
    target.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_agent_config(target)
    assert str(info.value).startswith(f"{target}: ")
    assert words in str(info.value)


def test_load_agent_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_agent_config(tmp_path / "absent.yaml")


@pytest.mark.parametrize("mode", [m for m in Mode if m is not Mode.EXTERNAL])
def test_defaults_for(mode: Mode) -> None:
    config = AgentConfiguration.defaults_for(mode, acknowledge_deprecation=True)
    assert config.mode is mode
    assert getattr(config, str(mode)) is not None
    assert sum(getattr(config, str(m)) is not None for m in Mode) == 1


def test_defaults_for_external_need_no_backend_image() -> None:
    """The agent runs no backend container in mode external (the operator does): its defaults
    have no `external` block, and the block's sync periods apply."""
    config = AgentConfiguration.defaults_for("external")
    assert config.mode is Mode.EXTERNAL and config.external is None
    block = config.mode_settings()
    assert (block.sync_period, block.min_sync_period) == ("30s", "1s")
    assert parse_agent_config({"mode": "external"}).external is None


def test_defaults_for_ipvs_needs_acknowledgement() -> None:
    with pytest.raises(ConfigError, match=r"ipvs\.acknowledgeDeprecation: mode ipvs is deprecated"):
        AgentConfiguration.defaults_for("ipvs")
    config = AgentConfiguration.defaults_for("ipvs", acknowledge_deprecation=True)
    assert isinstance(config.ipvs, IPVSSettings) and config.ipvs.acknowledge_deprecation


def test_the_package_exports_load_lazily_and_all_resolve() -> None:
    """`import kpx_api.errors` (the agent) must not build the CRD models; every name in
    `__all__` still resolves from the package."""
    import subprocess
    import sys

    import kpx_api

    assert sorted(kpx_api.__all__) == sorted(kpx_api._EXPORTS)
    for name in kpx_api.__all__:
        assert getattr(kpx_api, name) is not None
    probe = "import sys, kpx_api.agentconfig; print('kpx_api.proxyconfiguration' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
