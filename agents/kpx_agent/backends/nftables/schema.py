"""The nftables backend's chains, sets and maps, declared once as data, and its typed elements.

Every set and map of a family's table is a `SetDecl` here: its name, the kinds of its key's
fields, the kind of its value (none, a verdict, or endpoint fields) and its flags. The table
definition (`ruleset.base_table`), the nft text of elements (`element_text`), the netlink
encoder (`netlink_batch`), the rules that look them up (`rules.Lookup`, `rules.Vmap`) and the
kernel fake (`tests/unit/nft_fake.py`) all read these declarations; none of them declares a
layout of its own. Every chain of the fixed table is a `ChainDecl` (name, and for a base
chain its hook); `ruleset.base_table` gives each its rules.

An element is typed: `(set name, key, value)`, the key a tuple of fields (an `IP`, a
`Protocol`, an int port or bucket, an IP network for interval sets), the value None (a set),
a `Goto` (a verdict map) or a tuple of fields (an endpoint: IP and port). nft text and netlink
bytes are two serializations of the same values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import NamedTuple

from ...localnet import IPAddress, Protocol
from . import names as n


class Field(enum.Enum):
    """The kind of one field of a key or value; `typeof` is its nft expression."""

    ADDR = "addr"  # an IP address (ipv4_addr / ipv6_addr)
    NET = "net"  # an address interval (a network), in interval sets
    PROTO = "proto"  # inet_proto
    PORT = "port"  # inet_service
    BUCKET = "bucket"  # a `numgen random mod n` result


class Goto(NamedTuple):
    """A verdict map's value: `goto <chain>`."""

    chain: str

    def __str__(self) -> str:
        return f"goto {self.chain}"


KeyField = IPAddress | Protocol | int | IPv4Network | IPv6Network
Key = tuple[KeyField, ...]
Value = Goto | tuple[KeyField, ...] | None
Element = tuple[str, Key, Value]  # (set name, key, value)
Pair = tuple[Key, Value]


class ValueKind(enum.Enum):
    NONE = "none"  # a set
    VERDICT = "verdict"  # a verdict map (Goto values)
    ENDPOINT = "endpoint"  # a map to (address, port): the DNAT target


@dataclass(frozen=True, slots=True)
class SetDecl:
    """One set or map: name, key field kinds, value kind, flags, and (dynamic sets) timeout.
    `typeof` maps use nft expressions (`numgen` has no data type); the others use types."""

    name: str
    key: tuple[Field, ...]
    value: ValueKind = ValueKind.NONE
    interval: bool = False
    auto_merge: bool = False
    dynamic_timeout: int = 0  # seconds; a set the data path updates (session affinity)

    @property
    def is_map(self) -> bool:
        return self.value is not ValueKind.NONE

    @property
    def typeof(self) -> bool:
        return Field.BUCKET in self.key

    def body(self, family: int) -> str:
        """The definition as nft reads it inside `{ ... }` (without elements)."""
        if self.typeof:
            key = " . ".join(_typeof(f, family) for f in self.key)
            value = f"{_typeof(Field.ADDR, family)} . th dport"
            return f"typeof {key} : {value};"
        key = " . ".join(_type(f, family) for f in self.key)
        parts = [f"type {key}{' : verdict' if self.value is ValueKind.VERDICT else ''};"]
        if self.dynamic_timeout:
            parts.append(f"flags dynamic,timeout; timeout {self.dynamic_timeout}s;")
        elif self.interval:
            parts.append("flags interval;")
        if self.auto_merge:
            parts.append("auto-merge;")
        return " ".join(parts)

    @property
    def value_fields(self) -> tuple[Field, ...]:
        return (Field.ADDR, Field.PORT) if self.value is ValueKind.ENDPOINT else ()


def _type(f: Field, family: int) -> str:
    if f in (Field.ADDR, Field.NET):
        return n.ADDR_TYPE[family]
    return {Field.PROTO: "inet_proto", Field.PORT: "inet_service"}[f]


def _typeof(f: Field, family: int) -> str:
    return {
        Field.ADDR: n.DADDR[family],
        Field.PROTO: "meta l4proto",
        Field.PORT: "th dport",
        Field.BUCKET: "numgen random mod 2",
    }[f]


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


@dataclass(frozen=True, slots=True)
class ChainDecl:
    """A chain of the fixed table; a base chain has a hook (type, hook, priority) and the
    policy accept."""

    name: str
    hook: tuple[str, str, int] | None = None


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


# -- nft text of typed values (str.format of each field: IPs and networks as they print,
# protocols by their value, integers in decimal; one format per arity, no call per field)

_FORMATS = {1: "{}", 2: "{} . {}", 3: "{} . {} . {}", 4: "{} . {} . {} . {}"}


def key_text(key: Key) -> str:
    return _FORMATS[len(key)].format(*key)


def value_text(value: Value) -> str | None:
    if value is None:
        return None
    if type(value) is Goto:
        return f"goto {value.chain}"
    return _FORMATS[len(value)].format(*value)


def element_text(key: Key, value: Value) -> str:
    """One element as nft reads it in `{ ... }`."""
    if value is None:
        return key_text(key)
    return f"{key_text(key)} : {value_text(value)}"


def elements_text(pairs: Iterable[Pair]) -> str:
    """Elements as nft reads them in `{ ... }` (the hot path of a full sync's text)."""
    formats = _FORMATS
    out: list[str] = []
    append = out.append
    for key, value in pairs:
        text = formats[len(key)].format(*key)
        if value is None:
            append(text)
        elif type(value) is Goto:
            append(f"{text} : goto {value.chain}")
        else:
            append(f"{text} : {formats[len(value)].format(*value)}")
    return ", ".join(out)
