"""The ipvs mode's helper table, swapped in place by a full sync where it is in the kernel
(against the kernel fake): the same table as a full sync into an empty kernel, someone else's
chain or set in it deleted; where the kernel refuses the swap in place, or the table cannot be
listed, it is replaced whole."""

from __future__ import annotations

import logging
from ipaddress import ip_network

import pytest

from kpx_agent.backends.ipvs.backend import IpvsBackend
from kpx_agent.backends.ipvs.fake import FakeKernel
from kpx_agent.backends.kernel.nft_fake import FakeChain, FakeSet
from kpx_agent.backends.kernel.nft_schema import Field, SetDecl
from kpx_agent.backends.kernel.nft_transaction import RedefineTable, ReplaceTable, Transaction
from kpx_agent.model.service_ports import local_state
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)

SETTINGS = DataplaneSettings(cluster_cidrs=(ip_network("10.244.0.0/16"),))
NODE = NodeInfo("n1", (IP.of("192.168.0.1"),))
EPS = (Endpoint(IP.of("10.244.1.2"), 8080, True),)


def state(*names: str) -> NodeLocalState:
    ports = [
        ServicePort(
            ServicePortKey("d", name, "", Protocol.TCP, 4),
            80,
            cluster_ips=(IP.of(f"10.96.0.{i + 10}"),),
            load_balancer_ips=(IP.of(f"192.0.2.{i + 10}"),),
            load_balancer_source_ranges=(ip_network("198.51.100.0/24"),),
            cluster_endpoints=EPS,
            external_endpoints=EPS,
        )
        for i, name in enumerate(names)
    ]
    return local_state(NODE, SETTINGS, ports)


def tables(fake: FakeKernel) -> dict[int, str]:
    """Each family's helper table, canonical."""
    return {
        family: "\n".join(
            [f"set {k} {sorted(map(str, s.elements))}" for k, s in sorted(t.sets.items())]
            + [f"chain {k} {c.hook} {list(map(str, c.rules))}" for k, c in sorted(t.chains.items())]
        )
        for family, t in fake.tables.items()
    }


def fresh(s: NodeLocalState) -> dict[int, str]:
    fake = FakeKernel()
    IpvsBackend(SETTINGS, fake).sync(s, None)
    return tables(fake)


def swaps(fake: FakeKernel, since: int) -> list[type]:
    return [type(op) for txn in fake.nft[since:] for op in txn.ops[:1]]


def test_a_restart_swaps_the_helper_tables_in_place() -> None:
    fake, s = FakeKernel(), state("a", "b")
    IpvsBackend(SETTINGS, fake).sync(s, None)
    before = len(fake.nft)
    IpvsBackend(SETTINGS, fake).sync(state("a"), None)
    assert swaps(fake, before) == [RedefineTable, RedefineTable]
    assert "flush set ip kpx-ipvs firewall-allow" in fake.scripts()[before]
    assert tables(fake) == fresh(state("a"))


def test_someone_elses_chain_and_set_in_the_helper_table_are_deleted() -> None:
    fake, s = FakeKernel(), state("a")
    IpvsBackend(SETTINGS, fake).sync(s, None)
    fake.tables[4].chains["stray"] = FakeChain()
    fake.tables[4].sets["stray-set"] = FakeSet(SetDecl("stray-set", (Field.ADDR,)))
    IpvsBackend(SETTINGS, fake).sync(s, None)
    assert tables(fake) == fresh(s)


def test_a_refused_swap_in_place_falls_back_to_a_whole_replace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, s = FakeKernel(), state("a")
    IpvsBackend(SETTINGS, fake).sync(s, None)

    def refuse_in_place(txn: Transaction) -> str | None:
        return "File exists" if any(isinstance(op, RedefineTable) for op in txn.ops) else None

    fake.refuse_nft = refuse_in_place
    before = len(fake.nft)
    with caplog.at_level(logging.WARNING):
        IpvsBackend(SETTINGS, fake).sync(s, None)
    assert "cannot swap its contents in place" in caplog.text
    assert swaps(fake, before) == [ReplaceTable, ReplaceTable]
    assert tables(fake) == fresh(s)


def test_a_helper_table_that_cannot_be_listed_is_replaced_whole() -> None:
    fake, s = FakeKernel(), state("a")
    IpvsBackend(SETTINGS, fake).sync(s, None)
    fake.unlistable = {6}
    before = len(fake.nft)
    IpvsBackend(SETTINGS, fake).sync(s, None)
    assert swaps(fake, before) == [RedefineTable, ReplaceTable]
