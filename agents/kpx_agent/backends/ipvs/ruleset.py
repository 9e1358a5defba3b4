"""The ipvs backend's helper nftables table: the masquerade and drop rules IPVS cannot express.

Pure, in the kernel toolkit's nftables vocabulary (`kernel.nft_schema`, `kernel.nft_rules`,
`kernel.nft_transaction`): the sets are `SetDecl`s, the rules typed statements, a sync one
typed `Transaction` per family, rendered for `nft -f` in one place. What counts as "from a
local pod" (detectLocal) is the model's decision (`NodeFacts.local_pods`), the same one every
mode renders; nothing here reads the node or the detectLocal settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from ipaddress import ip_network

from ...model.types import IP, DataplaneSettings, NodeFacts, Protocol
from ..kernel.names import IPVS_TABLE
from ..kernel.nft_rules import (
    DPORT,
    L4PROTO,
    IifName,
    InNetworks,
    Jump,
    Lookup,
    MarkIsSet,
    MarkOr,
    Masquerade,
    Rule,
    Statement,
    Verdict,
    daddr,
    rule,
    saddr,
    vip_key,
)
from ..kernel.nft_schema import Field, KeyField, Pair, SetDecl
from ..kernel.nft_transaction import (
    ChainSpec,
    RedefineTable,
    TableContents,
    TableDef,
    Transaction,
)
from .model import CLUSTER_IPS, DROP, FIREWALL, FIREWALL_ALLOW, HAIRPIN, MASQ_IPS, Element

A, NET, P, PORT = Field.ADDR, Field.NET, Field.PROTO, Field.PORT
VPP = (A, P, PORT)
#: The helper table's sets, in the order the table declares them.
SETS: tuple[SetDecl, ...] = (
    SetDecl(CLUSTER_IPS, VPP),
    SetDecl(MASQ_IPS, VPP),
    SetDecl(HAIRPIN, (*VPP, A)),
    SetDecl(DROP, VPP),
    SetDecl(FIREWALL, VPP),
    SetDecl(FIREWALL_ALLOW, (*VPP, NET), interval=True),
)
_SET = {decl.name: decl for decl in SETS}
COMMENT = "kpx ipvs mode: masquerade and drops IPVS cannot express"
SERVICES = "services"
#: IPVS takes packets at LOCAL_IN (priority 98) and LOCAL_OUT (-99): the filters run before it.
PRIORITY_NAT_PRE, PRIORITY_NAT_POST, PRIORITY_FILTER = -100, 100, -110


def local_pods_match(facts: NodeFacts) -> tuple[Statement, ...] | None:
    """The match for traffic that is *not* from a local pod (the model's detectLocal match,
    negated); None when nothing tells local pods apart."""
    local = facts.local_pods
    if local.networks:
        return (InNetworks(saddr(facts.family), local.networks, negate=True),)
    if local.interface:
        return (IifName(local.interface, negate=True),)
    if local.interface_prefix:
        return (IifName(f"{local.interface_prefix}*", negate=True),)
    return None


def cluster_ip_masquerade(settings: DataplaneSettings, facts: NodeFacts) -> Rule:
    """The rule marking traffic to cluster IPs for masquerade, as upstream's ipvs mode: all of
    it with masqueradeAll; else what is not from a local pod (detectLocal); with nothing to
    tell local pods apart, only what the node sends from a Service IP (the source address the
    node picks for a cluster IP bound on kube-ipvs0 is that IP itself)."""
    family, cluster_ips = facts.family, _SET[CLUSTER_IPS]
    mark = MarkOr(settings.masquerade_mark)
    lookup = Lookup(vip_key(family), cluster_ips)
    if settings.masquerade_all:
        return rule(lookup, mark)
    not_local = local_pods_match(facts)
    if not_local is None:
        return rule(Lookup((saddr(family), L4PROTO, DPORT), cluster_ips), mark)
    return rule(lookup, *not_local, mark)


def table(settings: DataplaneSettings, facts: NodeFacts) -> TableDef:
    """One family's helper table, without elements."""
    family, mark = facts.family, settings.masquerade_mark
    vip = vip_key(family)
    with_source = (*vip, saddr(family))
    filters = (
        rule(Lookup(vip, _SET[DROP]), Verdict.DROP),
        rule(
            Lookup(vip, _SET[FIREWALL]),
            Lookup(with_source, _SET[FIREWALL_ALLOW], negate=True),
            Verdict.DROP,
        ),
    )
    chains = (
        ChainSpec(
            SERVICES,
            (
                cluster_ip_masquerade(settings, facts),
                rule(Lookup(vip, _SET[MASQ_IPS]), MarkOr(mark)),
            ),
        ),
        ChainSpec("prerouting", (rule(Jump(SERVICES)),), ("nat", "prerouting", PRIORITY_NAT_PRE)),
        ChainSpec("output", (rule(Jump(SERVICES)),), ("nat", "output", PRIORITY_NAT_PRE)),
        ChainSpec(
            "postrouting",
            (
                rule(MarkIsSet(mark), Masquerade(fully_random=False)),
                rule(
                    Lookup((daddr(family), L4PROTO, DPORT, saddr(family)), _SET[HAIRPIN]),
                    Masquerade(fully_random=False),
                ),
            ),
            ("nat", "postrouting", PRIORITY_NAT_POST),
        ),
        ChainSpec("filter-input", filters, ("filter", "input", PRIORITY_FILTER)),
        ChainSpec("filter-output", filters, ("filter", "output", PRIORITY_FILTER)),
    )
    return TableDef(family, SETS, {}, chains, COMMENT)


def _field(kind: Field, value: object) -> KeyField:
    """One field of a model element as the typed value the vocabulary holds (an `IP`, a
    `Protocol`, a port, a network)."""
    if kind is A:
        return IP.of(str(value))
    if kind is P:
        return Protocol(str(value))
    if kind is NET:
        return ip_network(str(value))
    return int(str(value))


def _pairs(family: int, set_name: str, members: Iterable[Element]) -> list[Pair]:
    """The model's elements of one family in one set as typed keys (the kernel fake checks
    each field's type, as the kernel checks its length)."""
    kinds = _SET[set_name].key
    return [
        (tuple(_field(k, v) for k, v in zip(kinds, e[1:], strict=True)), None)
        for e in members
        if e[0] == family
    ]


def full_sync(
    settings: DataplaneSettings,
    facts: NodeFacts,
    elements: Mapping[str, Iterable[Element]],
    contents: TableContents | None = None,
) -> Transaction:
    """Swap one family's helper table, elements included, in one transaction: in place where
    the table in the kernel holds `contents` (its sets emptied and refilled, its chains
    flushed and written again, anything else in it deleted at the end: a set created in a
    transaction can miss lookups around the commit, `nft_transaction.RedefineTable`), else
    deleted and defined again."""
    txn = Transaction(facts.family, IPVS_TABLE)
    definition = table(settings, facts)
    if contents is None:
        txn.replace_table(definition)
    else:
        txn.redefine_table(RedefineTable(definition, contents))
    for set_name, members in elements.items():
        txn.add_elements(set_name, _pairs(facts.family, set_name, members))
    if contents is not None:
        names = {d.name for d in definition.sets} | {c.name for c in definition.chains}
        txn.delete_others(contents, names)
    return txn


def element_changes(
    family: int, deletes: Mapping[str, Iterable[Element]], adds: Mapping[str, Iterable[Element]]
) -> Transaction:
    """One family's element deletions, then additions, as one transaction."""
    txn = Transaction(family, IPVS_TABLE)
    for set_name, members in deletes.items():
        txn.delete_elements(set_name, [key for key, _ in _pairs(family, set_name, members)])
    for set_name, members in adds.items():
        txn.add_elements(set_name, _pairs(family, set_name, members))
    return txn


def base_table(
    settings: DataplaneSettings, facts: NodeFacts, elements: Mapping[str, Iterable[Element]]
) -> str:
    """The nft text of `full_sync`."""
    return full_sync(settings, facts, elements).render()
