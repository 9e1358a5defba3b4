"""What two Services share in the nftables table is resolved before rendering: two Services on
one load-balancer IP and port with overlapping loadBalancerSourceRanges are one firewall
entry, whatever order they arrive in (the kernel refuses overlapping intervals in
`firewall-allow`, which once blocked every later sync)."""

from __future__ import annotations

import dataclasses
from ipaddress import ip_network

from backend_samples import NODE, SETTINGS, endpoints, key
from semantics import Packet

from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.model.service_ports import local_state
from kpx_agent.model.types import IP, NodeLocalState, Protocol, ServicePort

TCP = Protocol.TCP
LB = "192.0.2.50"


def lb_service(name: str, *ranges: str, cluster_ip: str = "10.96.0.50") -> ServicePort:
    eps = endpoints("10.244.2.2")
    return ServicePort(
        key(name),
        443,
        cluster_ips=(IP.of(cluster_ip),),
        load_balancer_ips=(IP.of(LB),),
        load_balancer_source_ranges=tuple(ip_network(r) for r in ranges),
        cluster_endpoints=eps,
        external_endpoints=eps,
    )


def backend_on(fake: FakeNftables) -> NftablesBackend:
    return NftablesBackend(SETTINGS, fake)


def state_of(*ports: ServicePort) -> NodeLocalState:
    return local_state(NODE, SETTINGS, list(ports))


def verdict_from(fake: FakeNftables, source: str) -> set[str]:
    packet = Packet(4, source, LB, TCP, 443, "external")
    return {o.verdict for o in fake.trace(packet)}


def test_overlapping_source_ranges_of_two_services_on_one_lb_port_in_later_syncs() -> None:
    fake = FakeNftables()
    backend = backend_on(fake)
    a = lb_service("a", "10.0.0.0/8")
    b = lb_service("b", "10.1.0.0/16", cluster_ip="10.96.0.51")
    state = state_of(a)
    backend.sync(state, None)
    state.services[b.key] = b
    backend.sync(state, [b.key])  # a second tenant, in a later partial sync
    c = dataclasses.replace(lb_service("c", cluster_ip="10.96.0.52"), load_balancer_ips=())
    state.services[c.key] = c
    backend.sync(state, [c.key])
    assert (IP.of("10.96.0.52"), TCP, 443) in fake.elements(4, n.CLUSTER_IPS)
    # As upstream's iptables mode (each Service's firewall in turn): a source gets through
    # when every Service on the address and port lets it in.
    assert verdict_from(fake, "10.1.2.3") == {"accept"}
    assert verdict_from(fake, "10.2.3.4") == {"drop"}
    assert verdict_from(fake, "192.168.0.1") == {"drop"}
    # Removing the narrower Service leaves the wider one's ranges.
    del state.services[b.key]
    backend.sync(state, [b.key])
    assert verdict_from(fake, "10.2.3.4") == {"accept"}
    del state.services[a.key]
    backend.sync(state, [a.key])
    assert fake.elements(4, n.FIREWALL_ALLOW) == {}
    assert fake.elements(4, n.FIREWALL_IPS) == {}


def test_full_and_partial_syncs_of_the_pair_agree() -> None:
    a = lb_service("a", "10.0.0.0/8", "192.168.0.0/16")
    b = lb_service("b", "10.1.0.0/16", "192.168.7.0/24", cluster_ip="10.96.0.51")
    full = FakeNftables()
    backend_on(full).sync(state_of(a, b), None)
    partial = FakeNftables()
    backend = backend_on(partial)
    state = state_of(b)
    backend.sync(state, None)
    state.services[a.key] = a
    backend.sync(state, [a.key])
    assert partial.dump() == full.dump()
    assert set(full.elements(4, n.FIREWALL_ALLOW)) == {
        (IP.of(LB), TCP, 443, ip_network("10.1.0.0/16")),
        (IP.of(LB), TCP, 443, ip_network("192.168.7.0/24")),
    }
