"""The kernel's nftables tables, faked, and a packet walk through them (the kernel toolkit's:
the nftables mode's fake holds its `kpx` tables in it, the ipvs mode's fake its helper table).

A table holds what the typed operations (`nft_transaction.Op`) put there: `SetDecl`s with
their typed elements, and chains of typed rules (`nft_rules.Rule`), kept as the objects
production builds, never as text. `apply` applies one operation as the kernel does it (an
element deleted must be there, re-adding a map key with another value fails, overlapping
intervals fail unless the set auto-merges, a chain or set still referenced cannot be deleted)
and `check_rules` resolves every set and chain the rules name, as the kernel does when a
transaction commits. Refusals raise `FakeError`.

`NftWalk` evaluates the typed statements of the table's base chains, hook by hook, for one
packet (`packet_walk.Walk`): lookups, comparisons, marks, conntrack state, random numbers,
verdict maps, DNAT (fixed or from an endpoint map) and masquerade.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from typing import cast

from ...model.types import IP, Protocol
from ..base import BackendError
from .names import NFT_FAMILIES
from .nft_rules import (
    Compare,
    CtState,
    CtStatus,
    Dnat,
    DnatMap,
    FibLocal,
    IifName,
    InNetworks,
    Jump,
    Lookup,
    MarkIsSet,
    MarkOr,
    MarkXor,
    Masquerade,
    PacketField,
    Payload,
    RandomIs,
    Rule,
    SetUpdate,
    Statement,
    Verdict,
    Vmap,
)
from .nft_schema import Field, Goto, Key, SetDecl, Value, ValueKind
from .nft_transaction import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    FlushChain,
    Op,
    RedefineTable,
    ReplaceTable,
    TableContents,
    TableDef,
)
from .packet_walk import Packet, Walk


@dataclass
class FakeSet:
    decl: SetDecl
    elements: dict[Key, Value] = field(default_factory=dict)


@dataclass
class FakeChain:
    rules: list[Rule] = field(default_factory=list)
    hook: tuple[str, str, int] | None = None


@dataclass
class FakeTable:
    family: int
    sets: dict[str, FakeSet] = field(default_factory=dict)
    chains: dict[str, FakeChain] = field(default_factory=dict)


class FakeError(BackendError):
    """What the kernel would refuse; nothing of the transaction is applied."""


# -- applying operations ---------------------------------------------------------------------------


def table_of(tables: dict[int, FakeTable], family: int, name: str = "") -> FakeTable:
    table = tables.get(family)
    if table is None:
        raise FakeError(f"{NFT_FAMILIES[family]} {name}: no such table".replace("  ", " "))
    return table


def apply(tables: dict[int, FakeTable], family: int, op: Op, name: str = "") -> None:
    """Apply one operation to the family's table (of the table called `name`)."""
    if isinstance(op, ReplaceTable):
        tables[family] = define(op.table)
        return
    if isinstance(op, RedefineTable):
        redefine(table_of(tables, family, name), op)
        return
    table = table_of(tables, family, name)
    match op:
        case AddSet(decl):
            found = table.sets.get(decl.name)
            if found is not None and found.decl != decl:
                raise FakeError(f"set {decl.name} exists with another definition")
            table.sets.setdefault(decl.name, FakeSet(decl))
        case AddChain(chain_name):
            table.chains.setdefault(chain_name, FakeChain())
        case FlushChain(chain_name):
            chain_of(table, chain_name).rules.clear()
        case AddRule(chain_name, rule):
            chain_of(table, chain_name).rules.append(rule)
        case DeleteChain(chain_name):
            chain_of(table, chain_name)
            if chain_users(table, chain_name):
                raise FakeError(f"chain {chain_name} is still used (EBUSY)")
            del table.chains[chain_name]
        case DeleteSet(set_name):
            if set_name not in table.sets:
                raise FakeError(f"set {set_name}: no such set (ENOENT)")
            if any(decl.name == set_name for decl, _ in _set_references(table)):
                raise FakeError(f"set {set_name} is still used by a rule (EBUSY)")
            del table.sets[set_name]
        case DeleteElements(set_name, keys):
            fake = set_of(table, set_name)
            for key in keys:
                if key not in fake.elements:
                    raise FakeError(f"set {set_name}: no element {key} (ENOENT)")
                del fake.elements[key]
        case AddElements(set_name, pairs):
            add_elements(table, set_name, list(pairs))
        case _:
            raise FakeError(f"unknown operation {op!r}")


def define(definition: TableDef) -> FakeTable:
    table = FakeTable(definition.family)
    for decl in definition.sets:
        table.sets[decl.name] = FakeSet(decl)
    for chain in definition.chains:
        table.chains[chain.name] = FakeChain(list(chain.rules), chain.hook)
    for set_name, keys in definition.elements.items():
        add_elements(table, set_name, [(k, None) for k in keys])
    return table


def redefine(table: FakeTable, op: RedefineTable) -> None:
    """`RedefineTable` as the kernel applies it: the listed sets and maps emptied but the kept
    sets, the listed chains flushed but the kept ones, the dropped sets and chains deleted,
    the definition added over what is left (a set kept with another declaration, or a chain
    with another hook, is the kernel's EEXIST)."""
    for set_name in (*op.contents.maps, *op.contents.sets):
        if set_name not in op.kept_sets:
            set_of(table, set_name).elements.clear()
    for chain_name in op.contents.chains:
        if chain_name not in op.kept:
            chain_of(table, chain_name).rules.clear()
    for set_name in op.dropped_sets:
        set_of(table, set_name)
        if any(decl.name == set_name for decl, _ in _set_references(table)):
            raise FakeError(f"set {set_name} is still used by a rule (EBUSY)")
        del table.sets[set_name]
    for chain_name in op.dropped_chains:
        chain_of(table, chain_name)
        if chain_users(table, chain_name):
            raise FakeError(f"chain {chain_name} is still used (EBUSY)")
        del table.chains[chain_name]
    definition = op.table
    for decl in definition.sets:
        found = table.sets.get(decl.name)
        if found is not None and found.decl != decl:
            raise FakeError(f"set {decl.name} exists with another definition (EEXIST)")
        table.sets.setdefault(decl.name, FakeSet(decl))
    for chain in definition.chains:
        existing = table.chains.get(chain.name)
        if existing is None:
            table.chains[chain.name] = FakeChain(list(chain.rules), chain.hook)
        elif existing.hook != chain.hook:
            raise FakeError(f"chain {chain.name} exists with another hook (EEXIST)")
        else:
            existing.rules += chain.rules
    for set_name, keys in definition.elements.items():
        add_elements(table, set_name, [(k, None) for k in keys])


def contents_of(table: FakeTable) -> TableContents:
    """What a listing of the table reads (`nft_query.table_contents`)."""
    return TableContents(
        chains={name: tuple(r.comment for r in c.rules) for name, c in table.chains.items()},
        sets=tuple(k for k, s in table.sets.items() if not s.decl.is_map),
        maps=tuple(k for k, s in table.sets.items() if s.decl.is_map),
    )


def chain_of(table: FakeTable, name: str) -> FakeChain:
    chain = table.chains.get(name)
    if chain is None:
        raise FakeError(f"chain {name}: no such chain (ENOENT)")
    return chain


def set_of(table: FakeTable, name: str) -> FakeSet:
    found = table.sets.get(name)
    if found is None:
        raise FakeError(f"set {name}: no such set (ENOENT)")
    return found


def _statements(table: FakeTable) -> Iterator[tuple[str, Statement]]:
    for chain_name, chain in table.chains.items():
        for rule in chain.rules:
            for statement in rule.statements:
                yield chain_name, statement


def _set_references(table: FakeTable) -> Iterator[tuple[SetDecl, ValueKind]]:
    """Each set a rule names, with the kind of value the rule reads from it."""
    for _, s in _statements(table):
        if isinstance(s, Lookup | SetUpdate):
            yield s.set, ValueKind.NONE
        elif isinstance(s, Vmap):
            yield s.map, ValueKind.VERDICT
        elif isinstance(s, DnatMap):
            yield s.map, ValueKind.ENDPOINT


def chain_users(table: FakeTable, name: str) -> bool:
    """Whether a rule jumps (or goes) to the chain, or a verdict map element goes to it."""
    if any(isinstance(s, Jump) and s.chain == name for _, s in _statements(table)):
        return True
    return any(value == Goto(name) for s in table.sets.values() for value in s.elements.values())


def check_rules(table: FakeTable) -> None:
    """Every set and chain a rule names exists, with the right kind (the kernel resolves them
    when the transaction commits)."""
    for chain_name, s in _statements(table):
        if isinstance(s, Jump):
            chain_of(table, s.chain)
            continue
        if isinstance(s, Lookup | SetUpdate):
            decl, kind = s.set, ValueKind.NONE
        elif isinstance(s, Vmap):
            decl, kind = s.map, ValueKind.VERDICT
        elif isinstance(s, DnatMap):
            decl, kind = s.map, ValueKind.ENDPOINT
        else:
            continue
        found = set_of(table, decl.name)
        if found.decl.value is kind:
            continue
        if kind is ValueKind.VERDICT:
            raise FakeError(f"{chain_name}: @{decl.name} is not a verdict map")
        if kind is ValueKind.ENDPOINT:
            raise FakeError(f"{chain_name}: @{decl.name} is not a data map")
        # A map looked up as a set: Linux 6.1 (Debian 12's kernel) refuses the rule with
        # EINVAL, though later kernels accept it.
        raise FakeError(f"{chain_name}: @{decl.name} is a map, looked up as a set")


def _check_field(family: int, kind: Field, value: object) -> bool:
    if kind is Field.ADDR:
        return isinstance(value, str) and IP.parse(value) == value and IP(value).version == family
    if kind is Field.NET:
        return isinstance(value, IPv4Network | IPv6Network) and value.version == family
    if kind is Field.PROTO:
        return isinstance(value, Protocol)
    if kind is Field.PORT:
        return type(value) is int and 0 <= value <= 0xFFFF
    return type(value) is int and value >= 0  # a numgen bucket


def add_elements(table: FakeTable, set_name: str, pairs: list[tuple[Key, Value]]) -> None:
    fake = set_of(table, set_name)
    decl, family = fake.decl, table.family
    for key, value in pairs:
        shown = f"set {set_name}: element {key!r}"
        if type(key) is not tuple or len(key) != len(decl.key):
            raise FakeError(f"{shown}: expected {len(decl.key)} fields")
        if not all(_check_field(family, k, v) for k, v in zip(decl.key, key, strict=True)):
            raise FakeError(f"{shown}: a field of the wrong type")
        if decl.value is ValueKind.NONE:
            if value is not None:
                raise FakeError(f"{shown}: a set element has no value")
        elif decl.value is ValueKind.VERDICT:
            if not isinstance(value, Goto):
                raise FakeError(f"{shown}: a verdict map needs a verdict")
            chain_of(table, value.chain)
        else:
            if not (
                isinstance(value, tuple)
                and len(value) == 2
                and all(
                    _check_field(family, k, v)
                    for k, v in zip(decl.value_fields, value, strict=True)
                )
            ):
                raise FakeError(f"{shown}: needs an (address, port) value")
        if key in fake.elements:
            if fake.elements[key] != value:
                raise FakeError(f"{shown}: exists with another value (EEXIST)")
            continue
        if decl.interval and not decl.auto_merge:
            for other in fake.elements:
                old, new = other[-1], key[-1]
                assert isinstance(old, IPv4Network | IPv6Network)
                if other[:-1] == key[:-1] and old.overlaps(new):  # type: ignore[arg-type]
                    raise FakeError(f"{shown}: overlaps {other!r} (EEXIST)")
        fake.elements[key] = value


# -- the packet walk ------------------------------------------------------------------------------


class _Goto(Exception):
    """A verdict map's element: go to its chain."""

    def __init__(self, chain: str) -> None:
        self.chain = chain


class _Verdict(Exception):
    def __init__(self, verdict: str) -> None:
        self.verdict = verdict


class NftWalk(Walk):
    """One packet's walk through one family's table: at each hook, the table's base chains of
    that hook, by priority, each rule's typed statements in order."""

    def __init__(self, table: FakeTable | None, packet: Packet, choices: list[int]) -> None:
        super().__init__(packet, choices)
        self.table = table

    def hook(self, hook: str) -> str:
        return self.nft_hook(hook)

    def nft_hook(self, hook: str, below: int | None = None, from_: int | None = None) -> str:
        """The verdict of the table's base chains at `hook` ("accept" if it has none), those
        of priority below `below` and from `from_` on when given."""
        if self.table is None:
            return "accept"
        chains = [
            (c.hook[2], name)
            for name, c in self.table.chains.items()
            if c.hook is not None
            and c.hook[1] == hook
            and (below is None or c.hook[2] < below)
            and (from_ is None or c.hook[2] >= from_)
        ]
        for _, name in sorted(chains):
            try:
                self.chain(name)
            except _Verdict as v:
                if v.verdict in ("drop", "reject"):
                    return v.verdict
        return "accept"

    def chain(self, name: str) -> None:
        """Run a chain; returns at its end or on `return`; raises _Verdict to stop the hook."""
        assert self.table is not None
        for rule in self.table.chains[name].rules:
            try:
                outcome = self.rule(rule)
            except _Goto as found:
                outcome = ("goto", found.chain)
            if outcome is None:
                continue
            kind, target = outcome
            if kind == "jump":
                self.chain(target)
            elif kind == "goto":
                self.chain(target)
                return
            else:
                raise _Verdict(kind)

    def rule(self, rule: Rule) -> tuple[str, str] | None:
        """None: the rule did not match (or matched with no verdict); else (verdict, chain)."""
        for s in rule.statements:
            match s:
                case Lookup(fields, decl, negate):
                    hit = self.lookup(decl.name, self.values(fields)) is not None
                    if hit == negate:
                        return None
                case Compare(payload, value, negate):
                    got = self.value(payload)
                    if isinstance(value, Protocol):
                        hit = got == value
                    else:
                        hit = ipaddress.ip_address(str(got)) in value
                    if hit == negate:
                        return None
                case InNetworks(payload, networks, negate):
                    source = ipaddress.ip_address(str(self.value(payload)))
                    hit = any(source in net for net in networks)
                    if hit == negate:
                        return None
                case IifName(name, negate):
                    iif = self.packet.iif
                    hit = iif.startswith(name[:-1]) if name.endswith("*") else iif == name
                    if hit == negate:
                        return None
                case FibLocal(which):
                    seen = self.packet.saddr if which is PacketField.SADDR else self.daddr
                    if not self.is_local(seen):
                        return None
                case MarkIsSet(mark):
                    if self.mark & mark != mark:
                        return None
                case CtState(state, negate):
                    # Every walked packet is a new connection's first.
                    if ("new" in state.split(",")) == negate:
                        return None
                case CtStatus(status, negate):
                    held = {"dnat"} if self.dnat else set()
                    if (status in held) == negate:
                        return None
                case RandomIs(modulus, value):
                    if self.choose(modulus) != value:
                        return None
                case MarkOr(mark):
                    self.mark |= mark
                case MarkXor(mark):
                    self.mark ^= mark
                case SetUpdate():
                    pass  # the dynamic set: empty in a fresh walk
                case Vmap(fields, decl):
                    found = self.lookup(decl.name, self.values(fields))
                    if found is None:
                        return None
                    assert isinstance(found, Goto)
                    raise _Goto(found.chain)
                case Dnat(_, to_address, to_port):
                    self.redirect(str(to_address), to_port)
                    return ("accept", "")
                case DnatMap(_, fields, buckets, decl):
                    target = self.lookup(decl.name, [*self.values(fields), self.choose(buckets)])
                    if target is None:
                        raise _Verdict("drop")  # no map element: the kernel drops the packet
                    assert isinstance(target, tuple)
                    self.redirect(str(target[0]), int(str(target[1])))
                    return ("accept", "")
                case Masquerade():
                    self.masquerade = True
                    return ("accept", "")
                case Verdict():
                    return (s.value, "")
                case Jump(chain, goto):
                    return ("goto" if goto else "jump", chain)
                case _:
                    raise AssertionError(f"the walk does not know {s!r}")
        return None

    def value(self, payload: Payload) -> object:
        match payload.field:
            case PacketField.DADDR:
                return IP.of(self.daddr)
            case PacketField.SADDR:
                return IP.of(self.packet.saddr)
            case PacketField.L4PROTO:
                return self.packet.protocol
            case PacketField.DPORT:
                return self.dport
        raise AssertionError(payload)

    def values(self, fields: tuple[Payload, ...]) -> list[object]:
        return [self.value(f) for f in fields]

    def lookup(self, set_name: str, values: list[object]) -> object:
        """The set's value for the key (True for a set member); None: not there."""
        assert self.table is not None
        fake = self.table.sets[set_name]
        key = cast(Key, tuple(values))
        if not fake.decl.interval:
            if key in fake.elements:
                found = fake.elements[key]
                return True if found is None else found
            return None
        address = ipaddress.ip_address(str(key[-1]))
        for element in fake.elements:
            net = element[-1]
            assert isinstance(net, IPv4Network | IPv6Network)
            if element[:-1] == key[:-1] and address in net:
                return True
        return None

    def redirect(self, address: str, port: int) -> None:
        """DNAT: the packet goes on to `address`:`port`."""
        self.dnat = (address, port)
        self.daddr, self.dport = IP.of(address), port
