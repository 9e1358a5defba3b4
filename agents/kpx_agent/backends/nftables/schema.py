"""The nftables backend's chains, sets and maps, declared once as data in the kernel toolkit's
vocabulary (`kernel.nft_schema`: `SetDecl`, `ChainDecl`, typed elements).

Every set and map of a family's table is a `SetDecl` here: its name, the kinds of its key's
fields, the kind of its value (none, a verdict, or endpoint fields) and its flags. The table
definition (`ruleset.base_table`), the nft text of elements (`element_text`), the netlink
encoder (`netlink_batch`), the rules that look them up (`kernel.nft_rules.Lookup`, `Vmap`) and the
kernel fake (`nftables.fake`) all read these declarations; none of them declares a
layout of its own. Every chain of the fixed table is a `ChainDecl` (name, and for a base
chain its hook); `ruleset.base_table` gives each its rules.
"""

from __future__ import annotations

from ..kernel.nft_schema import (
    ChainDecl,
    Element,
    Field,
    Goto,
    Key,
    KeyField,
    Pair,
    SetDecl,
    Value,
    ValueKind,
    element_text,
    elements_text,
    key_text,
    value_text,
)
from . import names as n

__all__ = [
    "ChainDecl",
    "Element",
    "Field",
    "Goto",
    "Key",
    "KeyField",
    "Pair",
    "SetDecl",
    "Value",
    "ValueKind",
    "element_text",
    "elements_text",
    "key_text",
    "value_text",
]


A, NET, P, PORT, B = Field.ADDR, Field.NET, Field.PROTO, Field.PORT, Field.BUCKET
VPP = (A, P, PORT)  # vip . protocol . port
PP = (P, PORT)  # protocol . port

# The sets and maps of each family's table, in the order the table declares them.
TABLE_SETS: tuple[SetDecl, ...] = (
    SetDecl(n.CLUSTER_IPS, VPP),
    SetDecl(n.EXTERNAL_IPS, VPP),
    SetDecl(n.REJECT_IPS, VPP),
    SetDecl(n.DROP_IPS, VPP),
    SetDecl(n.EXTERNAL_NODEPORTS, PP),
    SetDecl(n.REJECT_NODEPORTS, PP),
    SetDecl(n.DROP_NODEPORTS, PP),
    SetDecl(n.HAIRPIN, (A, A)),
    SetDecl(n.FIREWALL_IPS, VPP),
    SetDecl(n.FIREWALL_ALLOW, (*VPP, NET), interval=True),
    SetDecl(n.NODEPORT_ADDRESSES, (NET,), interval=True, auto_merge=True),
    SetDecl(n.LOCAL_POD_CIDRS, (NET,), interval=True, auto_merge=True),
    SetDecl(n.SERVICE_IPS, VPP, ValueKind.VERDICT),
    SetDecl(n.SERVICE_NODEPORTS, PP, ValueKind.VERDICT),
    SetDecl(n.SHORT_CIRCUIT_IPS, VPP, ValueKind.VERDICT),
    SetDecl(n.SHORT_CIRCUIT_NODEPORTS, PP, ValueKind.VERDICT),
    SetDecl(n.SHORT_CIRCUIT_IP_KEYS, VPP),
    SetDecl(n.SHORT_CIRCUIT_NODEPORT_KEYS, PP),
)
_BY_NAME = {decl.name: decl for decl in TABLE_SETS}


def table_set(name: str) -> SetDecl:
    """The declaration of one of the table's own sets and maps (KeyError for any other)."""
    return _BY_NAME[name]


PRIORITY_DSTNAT = -100  # nft 1.0.6 rejects the name `dstnat` on an output hook
PRIORITY_SRCNAT = 100
PRIORITY_FILTER = -1  # just before the default filter priority
PRIORITY_FIREWALL = -110  # before DNAT, while the destination is still the load balancer IP


# The chains of each family's table, in the order the table declares them.
TABLE_CHAINS: tuple[ChainDecl, ...] = (
    ChainDecl(n.SERVICES),
    ChainDecl(n.NO_ENDPOINTS),
    ChainDecl(n.FIREWALL),
    # Before DNAT, on both paths: traffic from pods and from the node itself.
    ChainDecl(n.FIREWALL_PREROUTING, ("filter", "prerouting", PRIORITY_FIREWALL)),
    ChainDecl(n.FIREWALL_OUTPUT, ("filter", "output", PRIORITY_FIREWALL)),
    ChainDecl(n.NAT_PREROUTING, ("nat", "prerouting", PRIORITY_DSTNAT)),
    ChainDecl(n.NAT_OUTPUT, ("nat", "output", PRIORITY_DSTNAT)),
    ChainDecl(n.NAT_POSTROUTING, ("nat", "postrouting", PRIORITY_SRCNAT)),
    ChainDecl(n.FILTER_INPUT, ("filter", "input", PRIORITY_FILTER)),
    ChainDecl(n.FILTER_FORWARD, ("filter", "forward", PRIORITY_FILTER)),
    ChainDecl(n.FILTER_OUTPUT, ("filter", "output", PRIORITY_FILTER)),
)
VERDICT_MAPS = frozenset(d.name for d in TABLE_SETS if d.value is ValueKind.VERDICT)


def endpoint_map(dispatch_map: str, count: int) -> SetDecl:
    """The map of the chain picking one of `count` endpoints for `dispatch_map`'s keys."""
    key = _BY_NAME[dispatch_map].key
    return SetDecl(n.endpoint_chain_of(dispatch_map, count), (*key, B), ValueKind.ENDPOINT)


def affinity_set(name: str, timeout: int) -> SetDecl:
    """A set of recent clients of one endpoint (session affinity)."""
    return SetDecl(name, (A,), dynamic_timeout=timeout)


def declaration(set_name: str) -> SetDecl | None:
    """The declaration of a table set or an endpoint map (None for other names: the
    affinity sets, which a sync creates with their chain and never fills)."""
    found = _BY_NAME.get(set_name)
    if found is not None:
        return found
    count = n.endpoint_count_of(set_name)
    return endpoint_map(*count) if count is not None else None
