"""nftables rules as typed values: the vocabulary's nft text, the checks a rule makes against
the declarations it reads, and the fixed table built only from declared chains and sets."""

from __future__ import annotations

from ipaddress import ip_network

import pytest
from backend_samples import GOLDEN, NODE, SETTINGS, sample_state, with_richer_endpoints

from kpx_agent.backends.kernel import nft_rules as r
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import NftScripts
from kpx_agent.backends.nftables.ruleset import base_table, endpoint_chain
from kpx_agent.backends.nftables.schema import (
    TABLE_CHAINS,
    TABLE_SETS,
    affinity_set,
    endpoint_map,
    table_set,
)
from kpx_agent.model.service_ports import node_facts
from kpx_agent.model.types import IP, Protocol

CLUSTER_IPS = table_set(n.CLUSTER_IPS)
SERVICE_IPS = table_set(n.SERVICE_IPS)


@pytest.mark.parametrize(
    ("statement", "text"),
    [
        (r.Lookup(r.vip_key(4), CLUSTER_IPS), "ip daddr . meta l4proto . th dport @cluster-ips"),
        (
            r.Lookup((*r.vip_key(6), r.saddr(6)), table_set(n.FIREWALL_ALLOW), negate=True),
            "ip6 daddr . meta l4proto . th dport . ip6 saddr != @firewall-allow",
        ),
        (r.Compare(r.saddr(4), ip_network("10.244.0.0/16")), "ip saddr 10.244.0.0/16"),
        (r.Compare(r.saddr(6), ip_network("fd00::/48"), True), "ip6 saddr != fd00::/48"),
        (r.Compare(r.L4PROTO, Protocol.SCTP), "meta l4proto sctp"),
        (r.IifName("veth*", negate=True), 'iifname != "veth*"'),
        (r.FibLocal(r.PacketField.DADDR), "fib daddr type local"),
        (r.MarkIsSet(0x4000), "meta mark & 0x00004000 == 0x00004000"),
        (r.MarkOr(0x4000), "meta mark set meta mark | 0x00004000"),
        (r.MarkXor(0x10), "meta mark set meta mark ^ 0x00000010"),
        (r.CtState("new"), "ct state new"),
        (r.CtStatus("dnat"), "ct status dnat"),
        (r.RandomIs(3), "numgen random mod 3 == 0"),
        (r.SetUpdate(affinity_set("aff-x", 10), r.saddr(4)), "update @aff-x { ip saddr }"),
        (
            r.Vmap(r.PORT_KEY, table_set(n.SERVICE_NODEPORTS)),
            "meta l4proto . th dport vmap @service-nodeports",
        ),
        (r.Dnat(4, IP.of("10.0.0.1"), 80), "dnat ip to 10.0.0.1:80"),
        (r.Dnat(6, IP.of("fd00::1"), 80), "dnat ip6 to [fd00::1]:80"),
        (
            r.DnatMap(6, r.vip_key(6), 3, endpoint_map(n.SERVICE_IPS, 3)),
            "dnat ip6 to ip6 daddr . meta l4proto . th dport . numgen random mod 3"
            " map @endpoints-3",
        ),
        (r.Masquerade(), "masquerade fully-random"),
        (r.Verdict.REJECT, "reject"),
        (r.Jump("services"), "jump services"),
        (r.Jump("endpoints-2", goto=True), "goto endpoints-2"),
    ],
)
def test_each_statement_has_one_nft_text(statement: r.Statement, text: str) -> None:
    assert r.statement_text(statement) == text
    assert str(r.rule(statement, r.Verdict.DROP)) == f"{text} drop"


def test_a_lookup_must_match_its_declaration() -> None:
    with pytest.raises(ValueError, match="3 key fields, not 2"):
        r.Lookup(r.PORT_KEY, CLUSTER_IPS)
    with pytest.raises(ValueError, match="looked up as a set"):  # Linux 6.1 refuses it
        r.Lookup(r.vip_key(4), SERVICE_IPS)
    with pytest.raises(ValueError, match="not a verdict map"):
        r.Vmap(r.vip_key(4), CLUSTER_IPS)
    with pytest.raises(ValueError, match="not an endpoint map"):
        r.DnatMap(4, r.PORT_KEY, 2, endpoint_map(n.SERVICE_IPS, 2))
    with pytest.raises(ValueError, match="needs a family"):
        r.Payload(r.PacketField.SADDR)


@pytest.mark.parametrize("family", [4, 6])
def test_the_fixed_table_uses_only_declared_chains_and_sets(family: int) -> None:
    table = base_table(SETTINGS, node_facts(SETTINGS, NODE)[family])
    assert [(c.name, c.hook) for c in table.chains] == [(d.name, d.hook) for d in TABLE_CHAINS]
    assert table.sets == TABLE_SETS
    chains = {c.name for c in table.chains}
    for chain in table.chains:
        assert chain.rules and all(isinstance(x, r.Rule) for x in chain.rules)
        for statement in (s for x in chain.rules for s in x.statements):
            if isinstance(statement, r.Lookup | r.Vmap):
                decl = statement.set if isinstance(statement, r.Lookup) else statement.map
                assert decl in TABLE_SETS, decl  # the very declaration, not a copy
            if isinstance(statement, r.Jump):
                assert statement.chain in chains
            fields = getattr(statement, "fields", ()) or (getattr(statement, "field", None),)
            for field in fields:
                if isinstance(field, r.Payload) and field.family:
                    assert field.family == family, statement


def test_an_endpoint_chain_reads_its_own_map() -> None:
    name, decl, rule = endpoint_chain(4, n.SERVICE_NODEPORTS, 2)
    assert name == decl.name == "nodeport-endpoints-2"
    assert rule.statements == (r.DnatMap(4, r.PORT_KEY, 2, decl),)
    assert rule.comment.startswith("kpx ")  # what a swap in place recognizes it by


def test_a_rule_comment_is_ours_only() -> None:
    assert str(r.Rule((r.Verdict.DROP,), "kpx 0a1b")) == 'drop comment "kpx 0a1b"'
    for bad in ('x" ; flush ruleset', "A" * 3, "a" * 65):
        with pytest.raises(ValueError, match="rule comment"):
            r.Rule((r.Verdict.DROP,), bad)


def test_rules_are_values() -> None:
    """Two renders of the same chain are equal (a partial sync compares them to decide what
    to rewrite), and hashable."""
    a = base_table(SETTINGS, node_facts(SETTINGS, NODE)[4]).chains
    b = base_table(SETTINGS, node_facts(SETTINGS, NODE)[4]).chains
    assert a == b and len({x for c in a for x in c.rules}) > 10


def test_endpoints_carrying_more_fields_render_the_same() -> None:
    """The backend reads an endpoint's address, port and locality by name: an endpoint that
    carries more (conditions, hints) renders the golden ruleset unchanged, affinity chain
    names included."""
    backend = NftablesBackend(SETTINGS, NftScripts())
    backend.sync(with_richer_endpoints(sample_state()), None)
    assert backend.last_script == (GOLDEN / "full_sync.nft").read_text()
