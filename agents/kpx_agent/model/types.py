"""The node-local state: what every backend receives (in the spirit of KPNG's localnetv1).

Plain, frozen, validated data. Backends never see Kubernetes objects: every Service behaviour
(readiness, terminating fallback, traffic policies, topology) is already decided here, and every
address and port has been parsed, so a backend can render it into a ruleset without re-checking.
"""

from __future__ import annotations

import enum
import re
import socket
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from typing import NamedTuple

IPNetwork = IPv4Network | IPv6Network


class IP(str):
    """A validated IP address in canonical text form.

    A str, so backends format it into rules with no conversion cost; built only by `parse`,
    which accepts nothing but a plain IPv4 or IPv6 address (no zone, no prefix, no spaces).
    At 100,000 endpoints this is several times cheaper than ipaddress objects.
    """

    __slots__ = ()

    @classmethod
    def parse(cls, text: object) -> IP | None:
        value = str(text)
        try:
            if ":" in value:
                return cls(
                    socket.inet_ntop(socket.AF_INET6, socket.inet_pton(socket.AF_INET6, value))
                )
            # inet_pton takes only canonical dotted quads (no leading zeros, no short forms).
            socket.inet_pton(socket.AF_INET, value)
            return cls(value)
        except (OSError, ValueError):
            return None

    @staticmethod
    def is_canonical(text: str) -> bool:
        """Whether `text` is an IP address in the canonical form `parse` gives (no object made:
        the store keeps such an endpoint address as the plain str it came as)."""
        try:
            if ":" in text:
                canonical = socket.inet_ntop(
                    socket.AF_INET6, socket.inet_pton(socket.AF_INET6, text)
                )
                return canonical == text
            socket.inet_pton(socket.AF_INET, text)
            return True
        except (OSError, ValueError):
            return False

    @classmethod
    def of(cls, text: str) -> IP:
        """`parse`, raising ValueError for anything that is not an IP address."""
        ip = cls.parse(text)
        if ip is None:
            raise ValueError(f"not an IP address: {text!r}")
        return ip

    @property
    def version(self) -> int:
        return 6 if ":" in self else 4

    @property
    def max_prefixlen(self) -> int:
        return 128 if ":" in self else 32


IPAddress = IP


def ip_version(address: str) -> int:
    """The family of a validated address (an `Endpoint`'s ip): 4 or 6."""
    return 6 if ":" in address else 4


class Protocol(enum.StrEnum):
    TCP = "tcp"
    UDP = "udp"
    SCTP = "sctp"


@dataclass(frozen=True, slots=True, order=True)
class ServicePortKey:
    """Identifies one port of one Service in one IP family."""

    namespace: str
    name: str
    port_name: str
    protocol: Protocol
    family: int  # 4 or 6

    def __str__(self) -> str:
        port = f":{self.port_name}" if self.port_name else ""
        return f"{self.namespace}/{self.name}{port}/{self.protocol.value}/v{self.family}"


class Endpoint(NamedTuple):
    """A usable endpoint (already filtered for readiness/terminating/topology).

    Its EndpointSlice conditions are not in the tuple (backends unpack and name rules after
    it): they are in `ServicePort.endpoint_conditions`. Its address is validated and in
    canonical form, but kept as the plain str the store holds (an `IP` object costs twice the
    memory, at 100,000 endpoints per 10,000 Services): `ip_version` gives its family."""

    ip: str
    port: int
    local: bool = False


class EndpointConditions(NamedTuple):
    """An endpoint's EndpointSlice conditions, as upstream reads them: `ready` (absent:
    true), `serving` (absent: as ready), `terminating` (absent: false)."""

    ready: bool = True
    serving: bool = True
    terminating: bool = False


#: The conditions of a plainly ready endpoint (what nearly every usable endpoint has).
READY = EndpointConditions()


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One Service port, one family, with the endpoints this node must use for it.

    `cluster_endpoints` serve traffic to the cluster IPs (internalTrafficPolicy applied);
    `external_endpoints` serve NodePort, externalIPs and load-balancer IPs
    (externalTrafficPolicy applied). An empty list means: reject (or drop, see the flags).
    """

    key: ServicePortKey
    port: int
    cluster_ips: tuple[IPAddress, ...] = ()
    external_ips: tuple[IPAddress, ...] = ()
    load_balancer_ips: tuple[IPAddress, ...] = ()
    node_port: int = 0
    cluster_endpoints: tuple[Endpoint, ...] = ()
    external_endpoints: tuple[Endpoint, ...] = ()
    # externalTrafficPolicy: Cluster -> masquerade external traffic; Local -> keep the source.
    external_masquerade: bool = True
    # internalTrafficPolicy: Local with no local endpoint -> drop, not reject.
    drop_when_no_cluster_endpoints: bool = False
    # externalTrafficPolicy: Local with no local endpoint -> drop external traffic.
    drop_when_no_external_endpoints: bool = False
    affinity_timeout: int = 0  # seconds; 0 = no session affinity
    load_balancer_source_ranges: tuple[IPNetwork, ...] = ()
    # The Service lists loadBalancerSourceRanges but none usable in this family (unparsable,
    # or all of the other family): no source may reach the load-balancer IPs (fail closed).
    # Backends filter load-balancer traffic when this is set or the ranges are non-empty.
    load_balancer_closed: bool = False
    health_check_node_port: int = 0
    # externalTrafficPolicy Local only: the endpoints for traffic to the external addresses
    # (NodePort, external IPs, load-balancer IPs) that comes from a local pod (detectLocal) or
    # from the node itself: every usable endpoint of the cluster, topology applied but not the
    # traffic policies (upstream's "short circuit"). Empty with the Cluster policy.
    short_circuit_endpoints: tuple[Endpoint, ...] = ()
    # The conditions of the endpoints above (any of the three lists) that are not READY, by
    # address, ordered: a serving-terminating endpoint used as the fallback, or a slice's
    # unusual combination. Empty in the usual case. Backends render the same rules whatever
    # the conditions (the lists are already decided); the state API serves them per endpoint.
    endpoint_conditions: tuple[tuple[str, EndpointConditions], ...] = ()

    @property
    def family(self) -> int:
        return self.key.family

    @property
    def load_balancer_firewall(self) -> bool:
        """Whether traffic to the load-balancer IPs is filtered by source (only
        `load_balancer_source_ranges` pass; none when `load_balancer_closed`)."""
        return self.load_balancer_closed or bool(self.load_balancer_source_ranges)

    def conditions_of(self, ip: str) -> EndpointConditions:
        """The conditions of one of this port's endpoints."""
        for address, conditions in self.endpoint_conditions:
            if address == ip:
                return conditions
        return READY

    @property
    def protocol(self) -> Protocol:
        return self.key.protocol


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the backends need to know about their own node."""

    name: str
    addresses: tuple[IPAddress, ...] = ()
    # Read by the model (topology hints), never by the backends: left out of equality, so a
    # zone change is no node change for the kernel (the proxier recomputes the Services
    # that use topology instead).
    zone: str = field(default="", compare=False)
    pod_cidrs: tuple[IPNetwork, ...] = ()


class DetectLocalMode(enum.StrEnum):
    """How traffic from this node's pods is told from other traffic (upstream's names)."""

    CLUSTER_CIDR = "ClusterCIDR"  # source in clusterCIDRs
    NODE_CIDR = "NodeCIDR"  # source in the Node's spec.podCIDRs
    BRIDGE_INTERFACE = "BridgeInterface"  # arriving on one bridge
    INTERFACE_NAME_PREFIX = "InterfaceNamePrefix"  # arriving on an interface with a prefix


_INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")


@dataclass(frozen=True, slots=True)
class DetectLocal:
    """The detectLocal setting, parsed: the mode and, for the interface modes, the interface
    name or prefix (checked again here: it is rendered into rules). The networks of the
    CIDR modes are not here: ClusterCIDR uses DataplaneSettings.cluster_cidrs, NodeCIDR the
    Node's pod CIDRs (NodeInfo.pod_cidrs); `kpx_agent.model.detect_local` combines them."""

    mode: DetectLocalMode = DetectLocalMode.CLUSTER_CIDR
    interface: str = ""  # bridge name (BridgeInterface) or name prefix (InterfaceNamePrefix)

    def __post_init__(self) -> None:
        wants_interface = self.mode in (
            DetectLocalMode.BRIDGE_INTERFACE,
            DetectLocalMode.INTERFACE_NAME_PREFIX,
        )
        if wants_interface != bool(self.interface):
            raise ValueError(f"detectLocal {self.mode}: interface {self.interface!r}")
        if self.interface and not _INTERFACE_NAME.fullmatch(self.interface):
            raise ValueError(f"not an interface name: {self.interface!r}")


@dataclass(frozen=True, slots=True)
class IPVSOptions:
    """spec.ipvs, parsed (the ipvs backend reads it; other modes ignore it)."""

    scheduler: str = "rr"
    strict_arp: bool = False
    exclude_cidrs: tuple[IPNetwork, ...] = ()
    tcp_timeout: int = 0  # seconds; 0 leaves the kernel's value
    tcp_fin_timeout: int = 0
    udp_timeout: int = 0


@dataclass(frozen=True, slots=True)
class DataplaneSettings:
    """The part of the agent configuration the backends act on, already parsed."""

    masquerade_bit: int = 14
    masquerade_all: bool = False
    cluster_cidrs: tuple[IPNetwork, ...] = ()
    # Empty: the node's own addresses ("primary"); otherwise NodePorts answer on local
    # addresses inside these networks.
    node_port_networks: tuple[IPNetwork, ...] = ()
    detect_local: DetectLocal = DetectLocal()
    # NodePorts also answer on 127.0.0.0/8 (IPv4; needs route_localnet=1). True only where the
    # mode's localhostNodePorts is true (iptables: the default, as upstream; nftables: kpx's
    # opt-in) and nodePortAddresses is empty or holds a network containing 127.0.0.1; always
    # False in other modes.
    localhost_node_ports: bool = False
    # conntrack.tcpBeLiberal: then forwarded conntrack-INVALID packets are not dropped.
    conntrack_tcp_be_liberal: bool = False
    # mode ipvs only: spec.ipvs.
    ipvs: IPVSOptions = IPVSOptions()
    # externalIPs.allowedCIDRs: the networks spec.externalIPs may be in; empty: the model's
    # default (external_ips.py). The model applies it; backends never read it.
    external_ip_networks: tuple[IPNetwork, ...] = ()

    @property
    def masquerade_mark(self) -> int:
        return 1 << self.masquerade_bit


@dataclass(frozen=True, slots=True)
class LocalPods:
    """One family's "from a local pod" match (detectLocal): networks, or an interface name
    or prefix; none of them (`implemented` False): nothing counts as local."""

    networks: tuple[IPNetwork, ...] = ()
    interface: str = ""  # exact name (BridgeInterface)
    interface_prefix: str = ""  # name prefix (InterfaceNamePrefix)

    @property
    def implemented(self) -> bool:
        return bool(self.networks or self.interface or self.interface_prefix)


NOTHING_LOCAL = LocalPods()


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What a backend renders about its node in one IP family, decided by the model
    (`kpx_agent.model.service_ports.node_facts`) once for every mode. When these change, the
    proxier asks for a full sync; a backend never compares node or settings itself."""

    family: int
    # Where NodePorts answer (the backend adds "and the address is local"): these networks;
    # None while the Node's addresses are unknown: every local address except loopback.
    nodeport_networks: tuple[IPNetwork, ...] | None = None
    local_pods: LocalPods = NOTHING_LOCAL
    # NodePorts also answer on 127.0.0.0/8 (IPv4 only; see DataplaneSettings).
    localhost_node_ports: bool = False


@dataclass
class NodeLocalState:
    """The complete node-local view: every Service port this node proxies, by key, and the
    node's facts per family (`facts[4]`, `facts[6]`)."""

    node: NodeInfo
    services: dict[ServicePortKey, ServicePort] = field(default_factory=dict)
    facts: dict[int, NodeFacts] = field(default_factory=dict)
