"""Settings shared by the ProxyConfiguration spec and the agent's configuration file."""

from __future__ import annotations

import ipaddress
from enum import StrEnum
from typing import Annotated, Final

from pydantic import Field

from kpx_api.constants import OPT_OUT_LABEL, OPT_OUT_VALUE
from kpx_api.durations import Duration, parse_duration
from kpx_api.modes import (
    ACKNOWLEDGE_IPVS_MESSAGE,
    SETTINGS_CLASS,
    ExternalSettings,
    IPTablesSettings,
    IPVSSettings,
    Mode,
    ModeSettings,
    NFTablesSettings,
)
from kpx_api.names import DNSLabel
from kpx_api.networks import CIDR, BindAddress, ClusterCIDRs, NodePortAddresses, parse_cidr
from kpx_api.selectors import LabelSelector
from kpx_api.stateapi import StateAPI
from kpx_api.takeover import Takeover
from kpx_api.validation import KpxModel, Rule, SetList, Text


class Conntrack(KpxModel):
    """Conntrack table size and timeouts the agent sets on each node (upstream
    KubeProxyConntrackConfiguration)."""

    max_per_core: int = Field(
        default=32768,
        ge=0,
        le=2**31 - 1,
        strict=True,
        description="Conntrack entries to allow per CPU core: nf_conntrack_max = max(min, "
        "maxPerCore * the node's CPUs, capped at 1048576), only ever raised, and the "
        "nf_conntrack hashsize raised to a quarter of it; 0 leaves both unchanged.",
    )
    min: int = Field(
        default=131072,
        ge=0,
        le=2**31 - 1,
        strict=True,
        description="Lower bound of nf_conntrack_max, whatever maxPerCore gives (no effect "
        "with maxPerCore 0).",
    )
    tcp_established_timeout: Duration = Field(
        default="24h",
        description="Idle timeout of established TCP connections; 0s leaves it unchanged.",
    )
    tcp_close_wait_timeout: Duration = Field(
        default="1h",
        description="Timeout of TCP connections in CLOSE_WAIT; 0s leaves it unchanged.",
    )
    tcp_be_liberal: bool = Field(
        default=False,
        strict=True,
        description="Set nf_conntrack_tcp_be_liberal to 1: do not mark out-of-window TCP "
        "packets INVALID. false leaves the kernel's value unchanged.",
    )
    udp_timeout: Duration = Field(
        default="0s",
        description="Timeout of unreplied UDP flows; 0s leaves the kernel's value unchanged.",
    )
    udp_stream_timeout: Duration = Field(
        default="0s",
        description="Timeout of UDP streams (flows with replies); 0s leaves the kernel's value "
        "unchanged.",
    )

    def leaves_node_alone(self) -> bool:
        """Every setting at its leave-alone value (maxPerCore 0, timeouts 0s, tcpBeLiberal
        false): the agent then changes nothing on the node and needs no access to it."""
        timeouts = (
            self.tcp_established_timeout,
            self.tcp_close_wait_timeout,
            self.udp_timeout,
            self.udp_stream_timeout,
        )
        return (
            self.max_per_core == 0
            and not self.tcp_be_liberal
            and all(parse_duration(t) == 0 for t in timeouts)
        )


class DetectLocalMode(StrEnum):
    """How the agent tells traffic from local pods from other traffic."""

    CLUSTER_CIDR = "ClusterCIDR"
    NODE_CIDR = "NodeCIDR"
    BRIDGE_INTERFACE = "BridgeInterface"
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"


INTERFACE_NAME_PATTERN: Final = r"^[A-Za-z0-9_.-]+$"
_INTERFACE_MESSAGE = "must be an interface name: letters, digits, '_', '.' and '-'"
InterfaceName = Annotated[
    str,
    Text(max_length=15, min_length=1, pattern=INTERFACE_NAME_PATTERN, message=_INTERFACE_MESSAGE),
]


def _field_for_mode(field: str, alias: str, mode: DetectLocalMode) -> tuple[Rule, Rule]:
    return (
        Rule(
            cel=f"self.mode != '{mode}' || has(self.{alias})",
            message=f"{alias} is required when mode is {mode}",
            check=lambda d: d.mode is not mode or getattr(d, field) is not None,
            field_path=f".{alias}",
            reason="FieldValueRequired",
        ),
        Rule(
            cel=f"!has(self.{alias}) || self.mode == '{mode}'",
            message=f"{alias} is only used when mode is {mode}",
            check=lambda d: getattr(d, field) is None or d.mode is mode,
            field_path=f".{alias}",
            reason="FieldValueForbidden",
        ),
    )


class DetectLocal(KpxModel):
    """How to recognise traffic coming from pods of the local node (upstream detectLocalMode
    and detectLocal)."""

    __rules__ = (
        *_field_for_mode("bridge_interface", "bridgeInterface", DetectLocalMode.BRIDGE_INTERFACE),
        *_field_for_mode(
            "interface_name_prefix", "interfaceNamePrefix", DetectLocalMode.INTERFACE_NAME_PREFIX
        ),
    )

    mode: DetectLocalMode = Field(
        default=DetectLocalMode.CLUSTER_CIDR,
        description="ClusterCIDR: source in spec.clusterCIDRs (without clusterCIDRs no "
        "traffic counts as local); NodeCIDR: source in the node's spec.podCIDRs; "
        "BridgeInterface: arriving on bridgeInterface; InterfaceNamePrefix: arriving on an "
        "interface whose name starts with interfaceNamePrefix.",
    )
    bridge_interface: InterfaceName | None = Field(
        default=None,
        description="Bridge the pods are attached to (e.g. cbr0); required with mode "
        "BridgeInterface and rejected with other modes.",
    )
    interface_name_prefix: InterfaceName | None = Field(
        default=None,
        description="Prefix of the pods' interface names (e.g. veth); required with mode "
        "InterfaceNamePrefix and rejected with other modes.",
    )


def _default_opt_out_selector() -> LabelSelector:
    return LabelSelector(match_labels={OPT_OUT_LABEL: OPT_OUT_VALUE})


_EMPTY_SELECTOR_MESSAGE = (
    "selector must not be empty: an empty selector would opt out every namespace"
)


class NamespaceOptOut(KpxModel):
    """Namespaces whose Services the agents do not proxy: those listed by name, and those
    whose labels match the selector."""

    __rules__ = (
        Rule(
            cel="size(self.selector.matchLabels) > 0 || size(self.selector.matchExpressions) > 0",
            message=_EMPTY_SELECTOR_MESSAGE,
            check=lambda o: not o.selector.is_empty(),
            field_path=".selector",
        ),
    )

    namespaces: Annotated[list[DNSLabel], Field(max_length=1000), SetList()] = Field(
        default_factory=list,
        description="Names of the namespaces to opt out.",
    )
    selector: LabelSelector = Field(
        default_factory=_default_opt_out_selector,
        description=f"Namespaces with matching labels are opted out. Default: matchLabels "
        f"{{{OPT_OUT_LABEL}: {OPT_OUT_VALUE}}}. An empty selector is rejected because it "
        "would match every namespace.",
    )

    def opts_out(self, name: str, labels: dict[str, str]) -> bool:
        """Whether the namespace `name` with these labels is opted out."""
        return name in self.namespaces or self.selector.matches(labels)


def _block_rule(mode: Mode) -> Rule:
    return Rule(
        cel=f"!has(self.{mode}) || self.mode == '{mode}'",
        message=f"spec.{mode} is set but spec.mode is not {mode}: only the block of the selected "
        "mode may be set",
        message_expression=f"'spec.{mode} is set but spec.mode is ' + self.mode + "
        "': only the block of the selected mode may be set'",
        render=lambda s: (
            f"spec.{mode} is set but spec.mode is {s.mode}: only the block of the "
            "selected mode may be set"
        ),
        check=lambda s: getattr(s, str(mode)) is None or s.mode is mode,
        field_path=f".{mode}",
        reason="FieldValueForbidden",
    )


_NOT_SELECTED = (
    " Only the block of the selected mode may be set: the apiserver rejects the blocks of "
    "other modes, which would have no effect. When absent, its defaults apply."
)


class ExternalIPs(KpxModel):
    """Which addresses Services may claim in spec.externalIPs on the nodes (upstream only
    documents restricting them, with admission control)."""

    allowed_cidrs: Annotated[list[CIDR], Field(max_length=64), SetList()] = Field(
        default_factory=list,
        alias="allowedCIDRs",
        description="Networks spec.externalIPs entries may be in: an entry outside all of them "
        "is not programmed (Warning Event ExternalIPRefused on the Service). Empty: any "
        "address but the node's own addresses and the apiserver's (the endpoints of "
        "default/kubernetes). Loopback, link-local, multicast and unspecified addresses are "
        "refused in either case.",
    )


#: spec.external is required with mode external: the operator runs its backend container. The
#: agent's own configuration (AgentConfiguration) does without: the agent never runs it.
EXTERNAL_BLOCK_RULE = Rule(
    cel="self.mode != 'external' || has(self.external)",
    message="mode external needs spec.external (at least the backend's image)",
    check=lambda s: s.mode is not Mode.EXTERNAL or s.external is not None,
    field_path=".external",
    reason="FieldValueRequired",
)


class ProxySettings(KpxModel):
    """What the agents do on every node: the mode, its settings, and the shared settings."""

    __rules__ = (
        *(_block_rule(mode) for mode in Mode),
        Rule(
            cel="self.mode != 'ipvs' || (has(self.ipvs) && self.ipvs.acknowledgeDeprecation)",
            message=ACKNOWLEDGE_IPVS_MESSAGE,
            check=lambda s: (
                s.mode is not Mode.IPVS or (s.ipvs is not None and s.ipvs.acknowledge_deprecation)
            ),
            field_path=".ipvs.acknowledgeDeprecation",
            reason="FieldValueRequired",
        ),
        EXTERNAL_BLOCK_RULE,
    )

    mode: Mode = Field(
        description="Dataplane the agents program: nftables (recommended), iptables, or ipvs "
        "(deprecated upstream: needs ipvs.acknowledgeDeprecation: true; the operator's "
        "--ipvs-policy may deny it), or external (no kernel rules: the agents serve the node-local "
        "state API to the backend container of spec.external). Required: there is no default."
    )
    nftables: NFTablesSettings | None = Field(
        default=None, description="Settings of mode nftables." + _NOT_SELECTED
    )
    iptables: IPTablesSettings | None = Field(
        default=None, description="Settings of mode iptables." + _NOT_SELECTED
    )
    ipvs: IPVSSettings | None = Field(
        default=None,
        description="Settings of mode ipvs; acknowledgeDeprecation: true is required to use "
        "mode ipvs." + _NOT_SELECTED,
    )
    external: ExternalSettings | None = Field(
        default=None,
        description="Settings of mode external, required with it: the user's backend "
        "container, run as a sidecar of each agent, which programs the dataplane from the "
        "agent's node-local state API (the agent programs no kernel rules). Only the block of "
        "the selected mode may be set.",
    )
    conntrack: Conntrack = Field(
        default_factory=Conntrack, description="Conntrack table size and timeouts."
    )
    cluster_cidrs: ClusterCIDRs = Field(
        default_factory=list,
        alias="clusterCIDRs",
        description="Pod CIDRs of the cluster, at most one IPv4 and one IPv6. Traffic from "
        "them counts as cluster traffic (detectLocal mode ClusterCIDR) and traffic from "
        "elsewhere is masqueraded.",
    )
    node_port_addresses: NodePortAddresses = Field(
        default_factory=list,
        description="CIDRs of the node addresses that accept NodePort traffic, or the single "
        "value \"primary\" (the node's primary IPs). Empty: the node's primary IPs in mode "
        "nftables, every local IP in modes iptables and ipvs (as upstream).",
    )
    detect_local: DetectLocal = Field(
        default_factory=DetectLocal,
        description="How the agents recognise traffic from pods of their own node.",
    )
    external_ips: ExternalIPs = Field(
        default_factory=ExternalIPs,
        alias="externalIPs",
        description="Which addresses Services' spec.externalIPs may use (docs/api.md).",
    )
    healthz_bind_address: BindAddress = Field(
        default="0.0.0.0:10256",
        description="IP:port of the agent's health endpoint (/healthz, /livez); IPv6 as "
        "[address]:port.",
    )
    metrics_bind_address: BindAddress = Field(
        default="127.0.0.1:10249",
        description="IP:port of the agent's Prometheus endpoint (/metrics); IPv6 as "
        "[address]:port.",
    )
    namespace_opt_out: NamespaceOptOut = Field(
        default_factory=NamespaceOptOut,
        description="Namespaces whose Services the agents leave alone. Default: the "
        f"namespaces labelled {OPT_OUT_LABEL}={OPT_OUT_VALUE}.",
    )
    state_api: StateAPI = Field(
        default_factory=StateAPI,
        alias="stateAPI",
        description="The node-local state API for out-of-tree backends (docs/state-api.md).",
    )
    takeover: Takeover = Field(
        default_factory=Takeover,
        description="Taking nodes over from upstream kube-proxy (docs/migrating.md).",
    )

    def mode_settings(self) -> ModeSettings:
        """The settings of the selected mode: its block, or that block's defaults."""
        block: ModeSettings | None = getattr(self, str(self.mode))
        # No block: the mode's defaults (mode external has none: a rule requires its block).
        return block if block is not None else SETTINGS_CLASS[self.mode]()  # type: ignore[call-arg]

    def localhost_node_ports_in_effect(self) -> bool:
        """Whether IPv4 NodePorts answer on 127.0.0.0/8: the mode's localhostNodePorts
        (iptables: on by default, as upstream; nftables: an opt-in, off by default; other
        modes have none), and nodePortAddresses empty or holding 127.0.0.1."""
        block = self.mode_settings()
        if not getattr(block, "localhost_node_ports", False):
            return False
        loopback = ipaddress.IPv4Address("127.0.0.1")
        nets = [parse_cidr(a) for a in self.node_port_addresses if a != "primary"]
        return not self.node_port_addresses or any(loopback in net for net in nets)
