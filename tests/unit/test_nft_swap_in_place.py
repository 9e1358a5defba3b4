"""A full sync over a table already in the kernel swaps its contents in place (against the
kernel fake): the result is the table a full sync into an empty kernel makes, whatever the
table held before (other Services, an endpoint chain changed behind the backend's back,
someone else's chain or set); the endpoint chains in use are kept; where the kernel refuses
the swap in place, or the table cannot be listed, the table is replaced whole."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from backend_samples import SETTINGS, sample_state

from kpx_agent.backends.kernel.nft_schema import Field, SetDecl
from kpx_agent.backends.kernel.nft_transaction import (
    ChainSpec,
    RedefineTable,
    ReplaceTable,
    TableContents,
    TableDef,
    Transaction,
)
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeChain, FakeNftables, FakeSet, FakeTable
from kpx_agent.backends.nftables.in_place import defined_names, in_place
from kpx_agent.backends.nftables.ruleset import endpoint_rule
from kpx_agent.model.types import NodeLocalState


def fresh_dump(state: NodeLocalState) -> str:
    """The tables a full sync of `state` makes in an empty kernel."""
    fake = FakeNftables()
    NftablesBackend(SETTINGS, fake).sync(state, None)
    return fake.dump()


def ops(backend: NftablesBackend, kind: type) -> list[object]:
    return [op for txn in backend._last_sent for op in txn.ops if isinstance(op, kind)]


def without(state: NodeLocalState, *names: str) -> NodeLocalState:
    services = {k: sp for k, sp in state.services.items() if k.name not in names}
    return dataclasses.replace(state, services=services)


def test_a_restart_swaps_in_place_and_keeps_the_endpoint_chains() -> None:
    fake, state = FakeNftables(), sample_state()
    NftablesBackend(SETTINGS, fake).sync(state, None)
    restarted = NftablesBackend(SETTINGS, fake)
    restarted.sync(state, None)
    assert not ops(restarted, ReplaceTable)
    (redefine,) = [op for op in ops(restarted, RedefineTable) if op.table.family == 4]
    assert isinstance(redefine, RedefineTable)
    assert {"endpoints-1", "endpoints-2", "nodeport-endpoints-2"} <= redefine.kept
    assert "delete table" not in restarted.last_script
    assert "add map ip kpx endpoints-2" not in restarted.last_script  # kept, emptied, refilled
    assert "flush map ip kpx endpoints-2" in restarted.last_script
    assert fake.dump() == fresh_dump(state)


def test_what_the_new_state_lacks_is_deleted() -> None:
    """Services gone: their endpoint chains and maps, affinity chain and sets, go too."""
    fake, state = FakeNftables(), sample_state()
    backend = NftablesBackend(SETTINGS, fake)
    backend.sync(state, None)
    smaller = without(state, "web", "np", "local", "sticky", "fw")
    assert any(name.startswith("aff-") for name in fake.tables[4].chains)
    backend.sync(smaller, None)
    assert "delete chain ip kpx endpoints-2" in backend.last_script
    assert fake.dump() == fresh_dump(smaller)
    assert not any(name.startswith("aff-") for name in fake.tables[4].chains)


def test_a_restart_keeps_the_clients_session_affinity() -> None:
    """The affinity sets are not emptied by a swap in place: the clients the data path
    recorded stay with their endpoints across a restart, as upstream's do; a sticky Service
    that is gone takes its sets along."""
    fake, state = FakeNftables(), sample_state()
    NftablesBackend(SETTINGS, fake).sync(state, None)
    table = fake.tables[4]
    affinity = sorted(name for name in table.sets if n.is_affinity_set(name))
    assert affinity and all(table.sets[name].decl.dynamic_timeout for name in affinity)
    client = ("10.244.9.9",)
    for name in affinity:  # what the data path's `update @set { ip saddr }` records
        table.sets[name].elements[client] = None
    restarted = NftablesBackend(SETTINGS, fake)
    restarted.sync(state, None)
    (redefine,) = [op for op in ops(restarted, RedefineTable) if op.table.family == 4]
    assert isinstance(redefine, RedefineTable) and redefine.kept_sets == frozenset(affinity)
    assert all(f"flush set ip kpx {name}\n" not in restarted.last_script for name in affinity)
    kept = fake.tables[4].sets  # (the fake applies a transaction to a copy of the table)
    assert all(kept[name].elements == {client: None} for name in affinity)
    # without the sticky Service, its sets are deleted at the end of the swap
    NftablesBackend(SETTINGS, fake).sync(without(state, "sticky"), None)
    assert not any(n.is_affinity_set(name) for name in fake.tables[4].sets)


def test_an_endpoint_chain_changed_behind_our_back_is_made_again() -> None:
    fake, state = FakeNftables(), sample_state()
    backend = NftablesBackend(SETTINGS, fake)
    backend.sync(state, None)
    expected = fake.dump()
    tampered = fake.tables[4].chains["endpoints-2"]
    fake.edit(lambda _: tampered.rules.append(tampered.rules[0]))
    backend.sync(state, None)
    (redefine,) = [op for op in ops(backend, RedefineTable) if op.table.family == 4]
    assert isinstance(redefine, RedefineTable)
    assert "endpoints-2" in redefine.dropped_chains and "endpoints-2" not in redefine.kept
    assert "add map ip kpx endpoints-2" in backend.last_script
    assert fake.dump() == expected


def test_someone_elses_chain_and_set_in_our_table_are_deleted() -> None:
    fake, state = FakeNftables(), sample_state()
    backend = NftablesBackend(SETTINGS, fake)
    backend.sync(state, None)
    expected = fake.dump()

    def intrude(tables: dict[int, FakeTable]) -> None:
        tables[4].chains["stray"] = FakeChain()
        tables[4].sets["stray-set"] = FakeSet(SetDecl("stray-set", (Field.ADDR,)))

    fake.edit(intrude)
    backend.sync(state, None)
    assert fake.dump() == expected


def test_a_kept_set_declared_otherwise_falls_back_to_a_whole_replace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The kernel refuses a set declared again with another declaration (EEXIST): the swap
    in place applies nothing, and the table is then replaced whole."""
    fake, state = FakeNftables(), sample_state()
    backend = NftablesBackend(SETTINGS, fake)
    backend.sync(state, None)
    expected = fake.dump()
    found = fake.tables[4].sets[n.NODEPORT_ADDRESSES]
    fake.edit(lambda _: setattr(found, "decl", SetDecl(n.NODEPORT_ADDRESSES, (Field.ADDR,))))
    with caplog.at_level(logging.WARNING):
        backend.sync(state, None)
    assert "cannot swap its contents in place" in caplog.text and "EEXIST" in caplog.text
    assert [op for op in ops(backend, ReplaceTable) if op.table.family == 4]
    assert fake.dump() == expected


def test_a_table_that_cannot_be_listed_is_replaced_whole() -> None:
    fake, state = FakeNftables(), sample_state()
    NftablesBackend(SETTINGS, fake).sync(state, None)
    fake.unlistable = {6}
    backend = NftablesBackend(SETTINGS, fake)
    backend.sync(state, None)
    assert {op.table.family for op in ops(backend, ReplaceTable)} == {6}
    assert {op.table.family for op in ops(backend, RedefineTable)} == {4}
    assert fake.dump() == fresh_dump(state)


TABLE = TableDef(
    4,
    sets=(SetDecl("addresses", (Field.NET,), interval=True),),
    elements={"addresses": ()},
    chains=(ChainSpec("services", ()),),
)


def ours(name: str) -> str:
    return endpoint_rule(4, name).comment


def test_in_place_keeps_an_endpoint_chain_holding_this_versions_rule_and_its_map() -> None:
    contents = TableContents(
        chains={
            "services": ("", "", ""),
            "endpoints-1": (ours("endpoints-1"),),
            "endpoints-2": (ours("endpoints-2"), ""),  # a rule added behind our back
            "endpoints-3": (ours("endpoints-3"),),  # its map is gone
            "endpoints-5": ("kpx 0123456789abcdef",),  # another version's rule
            "endpoints-6": ("",),  # a rule without our mark
        },
        sets=("addresses",),
        maps=("endpoints-1", "endpoints-2", "endpoints-4", "endpoints-5", "endpoints-6"),
    )
    redefine = in_place(TABLE, contents, lambda name: endpoint_rule(4, name))
    assert redefine.kept == {"endpoints-1"}
    assert redefine.dropped_chains == ("endpoints-2", "endpoints-3", "endpoints-5", "endpoints-6")
    dropped_maps = {"endpoints-2", "endpoints-4", "endpoints-5", "endpoints-6"}
    assert set(redefine.dropped_sets) == dropped_maps


def test_the_endpoint_rules_mark_is_a_digest_of_the_rule_and_its_map() -> None:
    assert ours("endpoints-2").startswith("kpx ") and len(ours("endpoints-2")) == 20
    assert ours("endpoints-2") != ours("endpoints-3") != ours("nodeport-endpoints-3")
    assert endpoint_rule(6, "endpoints-2").comment != ours("endpoints-2")
    assert endpoint_rule(4, "services").comment == ""


def test_the_swap_in_place_as_nft_reads_it() -> None:
    contents = TableContents(
        chains={"services": ("",), "endpoints-1": (ours("endpoints-1"),), "endpoints-2": ("",)},
        sets=("addresses",),
        maps=("endpoints-1", "endpoints-2"),
    )
    txn = Transaction(4, "kpx")
    txn.redefine_table(in_place(TABLE, contents, lambda name: endpoint_rule(4, name)))
    assert txn.render().splitlines()[:8] == [
        "add table ip kpx",
        "flush map ip kpx endpoints-1",
        "flush map ip kpx endpoints-2",
        "flush set ip kpx addresses",
        "flush chain ip kpx services",
        "flush chain ip kpx endpoints-2",
        "delete set ip kpx endpoints-2",
        "delete chain ip kpx endpoints-2",
    ]
    assert "table ip kpx {" in txn.render()
    assert defined_names(txn) == {"addresses", "services"}
