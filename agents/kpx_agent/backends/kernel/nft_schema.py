"""The nftables vocabulary every mode that writes nftables uses: the kinds of a set's key and
value fields, a set or map declared as data (`SetDecl`), a chain declared as data
(`ChainDecl`), typed elements and their nft text.

An element is typed: `(set name, key, value)`, the key a tuple of fields (an `IP`, a
`Protocol`, an int port or bucket, an IP network for interval sets), the value None (a set),
a `Goto` (a verdict map) or a tuple of fields (an endpoint: IP and port). nft text and netlink
bytes are two serializations of the same values. Pure; no mode's names.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import NamedTuple

from ...model.types import Protocol
from .names import NFT_ADDR_TYPE, NFT_FAMILIES


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


KeyField = str | Protocol | int | IPv4Network | IPv6Network  # str: a validated address
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
        return NFT_ADDR_TYPE[family]
    return {Field.PROTO: "inet_proto", Field.PORT: "inet_service"}[f]


def _typeof(f: Field, family: int) -> str:
    return {
        Field.ADDR: f"{NFT_FAMILIES[family]} daddr",
        Field.PROTO: "meta l4proto",
        Field.PORT: "th dport",
        Field.BUCKET: "numgen random mod 2",
    }[f]


@dataclass(frozen=True, slots=True)
class ChainDecl:
    """A chain of the fixed table; a base chain has a hook (type, hook, priority) and the
    policy accept."""

    name: str
    hook: tuple[str, str, int] | None = None


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
