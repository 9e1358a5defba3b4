"""nftables.localhostNodePorts (kpx's opt-in beyond upstream's nftables mode): what the
nftables backend renders with and without it, traced through the kernel fake, and the
route_localnet sysctl it sets. The kernel tier: tests/e2e/test_traffic_origin_kernel.py."""

from __future__ import annotations

import dataclasses
from ipaddress import ip_network
from pathlib import Path

import pytest
from backend_samples import GOLDEN, NODE, SETTINGS, check_golden, sample_state
from semantics import Outcome, Packet

from kpx_agent.backends.base import NodePaths
from kpx_agent.backends.nftables import create
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables, NftScripts
from kpx_agent.backends.nftables.ruleset import base_table, nodeport_addresses
from kpx_agent.backends.route_localnet import ROUTE_LOCALNET_FILE
from kpx_agent.model.service_ports import node_facts
from kpx_agent.model.types import DataplaneSettings, NodeFacts, Protocol

ON = dataclasses.replace(SETTINGS, localhost_node_ports=True)
LOCAL = frozenset({"10.242.0.1", "127.0.0.1", "fd00:242::1", "::1"})
GUARD = (
    "ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state != { established, related } "
    "ct status & dnat == 0 drop"
)


def nets(*cidrs: str) -> tuple[object, ...]:
    return tuple(ip_network(c) for c in cidrs)


@pytest.mark.parametrize(
    ("family", "networks", "localhost", "expected"),
    [
        # nodePortAddresses empty: the node's addresses, and 127.0.0.0/8 only when on.
        (4, ("10.242.0.1/32",), False, ("10.242.0.1/32",)),
        (4, ("10.242.0.1/32",), True, ("10.242.0.1/32", "127.0.0.0/8")),
        # Node addresses not known yet: every local address, loopback only when on.
        (4, None, True, ("0.0.0.0/0",)),
        (
            4,
            None,
            False,
            tuple(map(str, ip_network("0.0.0.0/0").address_exclude(ip_network("127.0.0.0/8")))),
        ),
        # A configured network holding 127.0.0.1: kept when on, loopback cut out when off.
        (4, ("127.0.0.1/32", "10.0.0.0/8"), True, ("10.0.0.0/8", "127.0.0.1/32")),
        (4, ("127.0.0.1/32", "10.0.0.0/8"), False, ("10.0.0.0/8",)),
        (4, ("0.0.0.0/0",), True, ("0.0.0.0/0",)),
        # IPv6 never has them (the model never sets them there): ::/0 as before.
        (6, None, False, ("::/0",)),
    ],
)
def test_nodeport_addresses_hold_loopback_only_with_localhost_node_ports(
    family: int, networks: tuple[str, ...] | None, localhost: bool, expected: tuple[str, ...]
) -> None:
    facts = NodeFacts(
        family,
        None if networks is None else nets(*networks),  # type: ignore[arg-type]
        localhost_node_ports=localhost,
    )
    assert tuple(map(str, nodeport_addresses(facts))) == tuple(sorted(expected))


def test_the_martian_guard_is_in_the_ipv4_input_and_output_hooks_only_when_on() -> None:
    for settings, guarded in ((ON, True), (SETTINGS, False)):
        facts = node_facts(settings, NODE)
        assert facts[4].localhost_node_ports is guarded and not facts[6].localhost_node_ports
        for family in (4, 6):
            chains = {
                c.name: [str(r) for r in c.rules]
                for c in base_table(settings, facts[family]).chains
            }
            want = guarded and family == 4
            assert (chains["filter-input"][0] == GUARD) is want, chains["filter-input"]
            assert (chains["filter-output"][0] == GUARD) is want, chains["filter-output"]
            assert GUARD not in chains["filter-forward"]


def test_full_sync_with_localhost_node_ports_golden() -> None:
    """The IPv4 table with the option: the guard, 127.0.0.0/8 in nodeport-addresses; the
    rest as in full_sync.nft."""
    kernel = NftScripts()
    backend = NftablesBackend(ON, kernel, ensure_sysctl=lambda path, value: None)
    backend.sync(sample_state(ON), None)
    check_golden(GOLDEN / "full_sync_localhost.nft", "".join(kernel.runs))


def synced(settings: DataplaneSettings) -> tuple[FakeNftables, list[tuple[Path, int]]]:
    fake, sysctls = FakeNftables(), []
    backend = NftablesBackend(
        settings,
        fake,
        ensure_sysctl=lambda path, value: sysctls.append((path, value)),
    )
    backend.sync(sample_state(settings), None)
    return fake, sysctls


def trace(fake: FakeNftables, saddr: str, dport: int, origin: str) -> set[Outcome]:
    packet = Packet(4, saddr, "127.0.0.1", Protocol.TCP, dport, origin, "eth0", LOCAL)
    return fake.trace(packet)


def test_traced_localhost_node_ports_on_and_off() -> None:
    """On: the node's 127.0.0.1:<nodePort> is DNATed to the endpoints and masqueraded; a
    packet from outside to 127.0.0.0/8 that is not DNATed (a port without a NodePort) is
    dropped at input. Off: 127.0.0.1:<nodePort> is not DNATed, and nothing is dropped (the
    kernel drops such martians itself while route_localnet stays 0)."""
    endpoints = {("10.244.1.2", 8080), ("10.244.2.2", 8080)}
    on, set_on = synced(ON)
    node = trace(on, "127.0.0.1", 30080, "node")
    assert {(o.verdict, o.masquerade) for o in node} == {("accept", True)}
    assert {o.dnat for o in node} == endpoints
    assert trace(on, "203.0.113.9", 22, "external") == {Outcome("drop")}
    assert trace(on, "127.0.0.1", 22, "node") == {Outcome("accept")}  # loopback to loopback
    assert set_on == [(ROUTE_LOCALNET_FILE, 1)]

    off, set_off = synced(SETTINGS)
    assert trace(off, "127.0.0.1", 30080, "node") == {Outcome("accept")}
    assert trace(off, "203.0.113.9", 22, "external") == {Outcome("accept")}
    assert set_off == []


def test_route_localnet_goes_to_the_mounted_file(tmp_path: Path) -> None:
    """In a pod the operator mounts the node's file elsewhere (--route-localnet-file, which
    the agent hands over as NodePaths); one that cannot be written is logged, and the rules
    still go in."""
    mounted = tmp_path / "route_localnet"
    mounted.write_text("0\n")
    assert create(ON, NodePaths(route_localnet=mounted))._route_localnet_file == mounted
    assert create(ON)._route_localnet_file == ROUTE_LOCALNET_FILE
    for target, written in ((mounted, "1\n"), (tmp_path / "missing", None)):
        fake = FakeNftables()
        NftablesBackend(ON, fake, route_localnet_file=target).sync(sample_state(ON), None)
        assert (target.read_text() if target.exists() else None) == written
        assert fake.elements(4, "nodeport-addresses")  # programmed either way
