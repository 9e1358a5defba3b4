"""nftables rules as typed values, and their one serializer to nft text (the kernel toolkit's:
the nftables mode's chains and the ipvs mode's helper table are written in it).

A rule is a tuple of statements from the small vocabulary below: the matches, lookups and
actions kpx's chains use, and nothing else. Statements hold parsed values (a family
number, `Protocol`s, networks, ints, the `SetDecl` a lookup reads) and never text from the
cluster; `rule_text` is the only place that turns them into nft syntax (`str(rule)` calls it,
so a rule prints where nft text is written). Rules go to the kernel only as nft text: netlink
carries set and map elements (`netlink_batch`), never rules.

A lookup names the declaration of its set (`nft_schema.SetDecl`) rather than a bare name, and
checks that the packet fields it looks up are as many as the set's key fields, and that a
verdict map is only used as one (Linux 6.1 refuses a verdict map looked up as a set).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from ...model.types import IPNetwork, Protocol
from .names import NFT_FAMILIES
from .nft_schema import SetDecl, ValueKind


class PacketField(enum.Enum):
    """A packet field a rule reads (the address fields of the rule's family)."""

    SADDR = "saddr"
    DADDR = "daddr"
    L4PROTO = "meta l4proto"
    DPORT = "th dport"


@dataclass(frozen=True, slots=True)
class Payload:
    """One packet field; addresses carry their family (`ip saddr`, `ip6 daddr`)."""

    field: PacketField
    family: int = 0

    def __post_init__(self) -> None:
        if self.field in (PacketField.SADDR, PacketField.DADDR) and self.family not in NFT_FAMILIES:
            raise ValueError(f"{self.field.value} needs a family, not {self.family!r}")


L4PROTO = Payload(PacketField.L4PROTO)
DPORT = Payload(PacketField.DPORT)


def saddr(family: int) -> Payload:
    return Payload(PacketField.SADDR, family)


def daddr(family: int) -> Payload:
    return Payload(PacketField.DADDR, family)


def vip_key(family: int) -> tuple[Payload, ...]:
    """destination address . protocol . port: the key of the VIP sets and maps."""
    return (daddr(family), L4PROTO, DPORT)


PORT_KEY = (L4PROTO, DPORT)  # protocol . port: the key of the NodePort sets and maps


# -- matches


@dataclass(frozen=True, slots=True)
class Lookup:
    """`fields @set` (or `!= @set`): the fields, concatenated, are (not) in the set."""

    fields: tuple[Payload, ...]
    set: SetDecl
    negate: bool = False

    def __post_init__(self) -> None:
        _check_key(self.fields, self.set)
        if self.set.value is ValueKind.VERDICT:
            raise ValueError(f"verdict map {self.set.name} looked up as a set")


@dataclass(frozen=True, slots=True)
class Compare:
    """`field value` (or `field != value`): an address in a network, or a protocol."""

    field: Payload
    value: IPNetwork | Protocol
    negate: bool = False


@dataclass(frozen=True, slots=True)
class InNetworks:
    """`field { net, ... }` (or `field != { net, ... }`): an address in one of the networks."""

    field: Payload
    networks: tuple[IPNetwork, ...]
    negate: bool = False

    def __post_init__(self) -> None:
        if not self.networks:
            raise ValueError(f"{self.field.field.value}: no networks to compare with")


@dataclass(frozen=True, slots=True)
class IifName:
    """`iifname "name"` (or `!=`): the input interface, by name; a trailing `*` is a prefix
    match. The name is the validated one of the detectLocal settings."""

    name: str
    negate: bool = False


@dataclass(frozen=True, slots=True)
class FibLocal:
    """`fib saddr|daddr type local`: the address is one of the node's."""

    field: PacketField  # SADDR or DADDR


@dataclass(frozen=True, slots=True)
class MarkIsSet:
    """`meta mark & mark == mark`: every bit of `mark` is set."""

    mark: int


@dataclass(frozen=True, slots=True)
class CtState:
    """`ct state new`; with several states, `ct state { established, related }`; `negate`d:
    the packet's state (one of them) is none of these."""

    state: str  # "new", or "established,related"
    negate: bool = False


@dataclass(frozen=True, slots=True)
class CtStatus:
    """`ct status dnat`: the bit is set; `negate`d, `ct status & dnat == 0` (ct status is a
    bitmask: `!= dnat` would compare the whole value)."""

    status: str  # "dnat"
    negate: bool = False


@dataclass(frozen=True, slots=True)
class RandomIs:
    """`numgen random mod modulus == value`."""

    modulus: int
    value: int = 0


# -- actions


@dataclass(frozen=True, slots=True)
class MarkOr:
    """`meta mark set meta mark | mark`."""

    mark: int


@dataclass(frozen=True, slots=True)
class MarkXor:
    """`meta mark set meta mark ^ mark`."""

    mark: int


@dataclass(frozen=True, slots=True)
class SetUpdate:
    """`update @set { field }`: add (or refresh) the packet's field in a dynamic set."""

    set: SetDecl
    field: Payload

    def __post_init__(self) -> None:
        _check_key((self.field,), self.set)


@dataclass(frozen=True, slots=True)
class Vmap:
    """`fields vmap @map`: the verdict the map holds for the fields (if any)."""

    fields: tuple[Payload, ...]
    map: SetDecl

    def __post_init__(self) -> None:
        _check_key(self.fields, self.map)
        if self.map.value is not ValueKind.VERDICT:
            raise ValueError(f"{self.map.name} is not a verdict map")


@dataclass(frozen=True, slots=True)
class Dnat:
    """`dnat <family> to address:port` (a fixed destination)."""

    family: int
    address: str  # validated (an endpoint's: model/types.py Endpoint)
    port: int


@dataclass(frozen=True, slots=True)
class DnatMap:
    """`dnat <family> to fields . numgen random mod buckets map @map`: the destination the
    endpoint map holds for the fields and a random bucket."""

    family: int
    fields: tuple[Payload, ...]
    buckets: int
    map: SetDecl

    def __post_init__(self) -> None:
        if len(self.fields) + 1 != len(self.map.key) or self.map.value is not ValueKind.ENDPOINT:
            raise ValueError(f"{self.map.name} is not an endpoint map keyed by these fields")


@dataclass(frozen=True, slots=True)
class Masquerade:
    fully_random: bool = True


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DROP = "drop"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class Jump:
    """`jump chain` (or `goto chain`)."""

    chain: str
    goto: bool = False


Statement = (
    Lookup
    | Compare
    | InNetworks
    | IifName
    | FibLocal
    | MarkIsSet
    | CtState
    | CtStatus
    | RandomIs
    | MarkOr
    | MarkXor
    | SetUpdate
    | Vmap
    | Dnat
    | DnatMap
    | Masquerade
    | Verdict
    | Jump
)


# What a rule's comment may hold (kpx's own marks only: it is written into nft text).
_COMMENT = re.compile(r"[a-z0-9 -]{0,64}")


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule: its statements, in order, and a comment (nft keeps it as the rule's user
    data: it changes nothing on the data path)."""

    statements: tuple[Statement, ...]
    comment: str = ""

    def __post_init__(self) -> None:
        if not _COMMENT.fullmatch(self.comment):
            raise ValueError(f"rule comment {self.comment!r}: not [a-z0-9 -], up to 64")

    def __str__(self) -> str:
        return rule_text(self)


def rule(*statements: Statement) -> Rule:
    return Rule(statements)


def _check_key(fields: tuple[Payload, ...], decl: SetDecl) -> None:
    if len(fields) != len(decl.key):
        raise ValueError(f"{decl.name} has {len(decl.key)} key fields, not {len(fields)}")


# -- the nft text serializer


def rule_text(r: Rule) -> str:
    """The rule as nft reads it after `add rule <table> <chain>`."""
    text = " ".join(statement_text(s) for s in r.statements)
    return f'{text} comment "{r.comment}"' if r.comment else text


def _payload(p: Payload) -> str:
    if p.field in (PacketField.SADDR, PacketField.DADDR):
        return f"{NFT_FAMILIES[p.family]} {p.field.value}"
    return p.field.value


def _fields(fields: tuple[Payload, ...]) -> str:
    return " . ".join(_payload(f) for f in fields)


def _mark(mark: int) -> str:
    return f"0x{mark:08x}"


def statement_text(s: Statement) -> str:
    """One statement as nft reads it."""
    if isinstance(s, Lookup):
        return f"{_fields(s.fields)} {'!= ' if s.negate else ''}@{s.set.name}"
    if isinstance(s, Compare):
        value = s.value.value if isinstance(s.value, Protocol) else str(s.value)
        return f"{_payload(s.field)} {'!= ' if s.negate else ''}{value}"
    if isinstance(s, InNetworks):
        nets = ", ".join(str(net) for net in s.networks)
        return f"{_payload(s.field)} {'!= ' if s.negate else ''}{{ {nets} }}"
    if isinstance(s, IifName):
        return f'iifname {"!= " if s.negate else ""}"{s.name}"'
    if isinstance(s, FibLocal):
        return f"fib {s.field.value} type local"
    if isinstance(s, MarkIsSet):
        return f"meta mark & {_mark(s.mark)} == {_mark(s.mark)}"
    if isinstance(s, CtState):
        states = s.state.split(",")
        value = states[0] if len(states) == 1 else "{ " + ", ".join(states) + " }"
        return f"ct state {'!= ' if s.negate else ''}{value}"
    if isinstance(s, CtStatus):
        if s.negate:
            return f"ct status & {s.status} == 0"
        return f"ct status {s.status}"
    if isinstance(s, RandomIs):
        return f"numgen random mod {s.modulus} == {s.value}"
    if isinstance(s, MarkOr):
        return f"meta mark set meta mark | {_mark(s.mark)}"
    if isinstance(s, MarkXor):
        return f"meta mark set meta mark ^ {_mark(s.mark)}"
    if isinstance(s, SetUpdate):
        return f"update @{s.set.name} {{ {_payload(s.field)} }}"
    if isinstance(s, Vmap):
        return f"{_fields(s.fields)} vmap @{s.map.name}"
    if isinstance(s, Dnat):
        target = f"[{s.address}]" if s.family == 6 else str(s.address)
        return f"dnat {NFT_FAMILIES[s.family]} to {target}:{s.port}"
    if isinstance(s, DnatMap):
        return (
            f"dnat {NFT_FAMILIES[s.family]} to {_fields(s.fields)} . numgen random mod"
            f" {s.buckets} map @{s.map.name}"
        )
    if isinstance(s, Masquerade):
        return "masquerade fully-random" if s.fully_random else "masquerade"
    if isinstance(s, Verdict):
        return s.value
    if isinstance(s, Jump):
        return f"{'goto' if s.goto else 'jump'} {s.chain}"
    raise TypeError(f"not a statement: {s!r}")
