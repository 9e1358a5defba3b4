"""What the ipvs backend wants in the kernel for one Service port: pure data, no I/O.

A Service port becomes IPVS virtual servers (one per cluster IP, external IP, load-balancer IP
and, for a NodePort, one per node address), the addresses to bind on the dummy interface, and
elements of the helper nftables table's sets (masquerade marks, hairpin, drops IPVS cannot say).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import ip_address

from ...model.types import DataplaneSettings, Endpoint, IPNetwork, NodeInfo, ServicePort
from ..source_ranges import common_ranges, merged

PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": socket.IPPROTO_SCTP}
#: ip_vs_svc flags: IP_VS_SVC_F_PERSISTENT (session affinity ClientIP).
PERSISTENT = 0x0001


@dataclass(frozen=True, slots=True, order=True)
class VirtualKey:
    """An IPVS virtual server's identity (what the kernel keys it by)."""

    family: int
    protocol: str
    address: str
    port: int


@dataclass(frozen=True, slots=True)
class VirtualServer:
    key: VirtualKey
    scheduler: str
    persistence: int  # seconds of ClientIP affinity; 0 = none
    real_servers: frozenset[tuple[str, int]]


#: An element of a helper set: (family, address, protocol, port) or, for hairpin,
#: (family, endpoint address, protocol, endpoint port, endpoint address).
Element = tuple[object, ...]


@dataclass(slots=True)
class PortPlan:
    """Everything one Service port puts in the kernel."""

    virtual_servers: dict[VirtualKey, VirtualServer] = field(default_factory=dict)
    bound: set[tuple[int, str]] = field(default_factory=set)  # (family, address) on the dummy
    elements: dict[str, set[Element]] = field(default_factory=dict)
    # The source ranges allowed per load-balancer (family, address, protocol, port): the
    # `firewall-allow` elements are those every Service on the address and port allows
    # (`allowed_elements`), never one Service's alone.
    firewall: dict[Element, tuple[IPNetwork, ...]] = field(default_factory=dict)

    def add(self, set_name: str, element: Element) -> None:
        self.elements.setdefault(set_name, set()).add(element)


#: The helper table's sets (names are the same in the ip and ip6 tables).
CLUSTER_IPS = "cluster-ips"  # marked for masquerade unless from a local pod
MASQ_IPS = "masquerade-ips"  # always marked (external traffic, ETP Cluster)
HAIRPIN = "hairpin"  # endpoint . proto . port . endpoint: a pod reaching itself
DROP = "drop-ports"  # traffic policy Local with no endpoint here: dropped, not rejected
FIREWALL = "firewall-ips"  # load-balancer IPs with loadBalancerSourceRanges
FIREWALL_ALLOW = "firewall-allow"  # address . proto . port . source range: let through


def allowed_elements(vip: Element, each: Iterable[Iterable[IPNetwork]]) -> set[Element]:
    """The `firewall-allow` elements of one load-balancer address and port, from the ranges of
    every Service port on it (`source_ranges.common_ranges`: overlapping ranges of two
    Services would make the kernel refuse the set)."""
    return {(*vip, str(net)) for net in common_ranges(each)}


def excluded(address: str, networks: tuple[IPNetwork, ...]) -> bool:
    ip = ip_address(address)
    return any(ip.version == n.version and ip in n for n in networks)


def node_port_addresses(node: NodeInfo, settings: DataplaneSettings, family: int) -> list[str]:
    """The node addresses a NodePort answers on (nodePortAddresses applied)."""
    addresses: list[str] = [a for a in node.addresses if a.version == family]
    if settings.node_port_networks:
        addresses = [a for a in addresses if excluded(a, settings.node_port_networks)]
    return addresses


def _real_servers(endpoints: tuple[Endpoint, ...]) -> frozenset[tuple[str, int]]:
    return frozenset((str(e.ip), e.port) for e in endpoints)


def plan_port(port: ServicePort, node: NodeInfo, settings: DataplaneSettings) -> PortPlan:
    plan = PortPlan()
    family = port.family
    protocol = port.protocol.value
    scheduler = settings.ipvs.scheduler
    affinity = port.affinity_timeout

    def virtual(address: str, vport: int, endpoints: tuple[Endpoint, ...]) -> None:
        key = VirtualKey(family, protocol, address, vport)
        plan.virtual_servers[key] = VirtualServer(
            key, scheduler, affinity, _real_servers(endpoints)
        )

    for ip in port.cluster_ips:
        virtual(ip, port.port, port.cluster_endpoints)
        plan.bound.add((family, ip))
        plan.add(CLUSTER_IPS, (family, ip, protocol, port.port))
        if not port.cluster_endpoints and port.drop_when_no_cluster_endpoints:
            plan.add(DROP, (family, ip, protocol, port.port))
    external: list[tuple[str, int]] = [
        (ip, port.port) for ip in (*port.external_ips, *port.load_balancer_ips)
    ]
    for ip in (*port.external_ips, *port.load_balancer_ips):
        plan.bound.add((family, ip))
    if port.node_port:
        external += [(a, port.node_port) for a in node_port_addresses(node, settings, family)]
    for address, vport in external:
        virtual(address, vport, port.external_endpoints)
        if port.external_masquerade:
            plan.add(MASQ_IPS, (family, address, protocol, vport))
        if not port.external_endpoints and port.drop_when_no_external_endpoints:
            plan.add(DROP, (family, address, protocol, vport))
    if port.load_balancer_firewall:
        ranges = merged(n for n in port.load_balancer_source_ranges if n.version == family)
        for ip in port.load_balancer_ips:
            plan.add(FIREWALL, (family, ip, protocol, port.port))
            plan.firewall[(family, ip, protocol, port.port)] = ranges
    for endpoint in {*port.cluster_endpoints, *port.external_endpoints}:
        plan.add(HAIRPIN, (family, str(endpoint.ip), protocol, endpoint.port, str(endpoint.ip)))
    return plan
