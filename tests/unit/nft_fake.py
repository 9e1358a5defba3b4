"""A fake of the kernel's nftables tables for the nftables backend, and a packet tracer.

In the spirit of sigs.k8s.io/knftables' Fake (our own code): `FakeNftables` applies the typed
transactions (`transaction.Transaction`) and element loads the backend sends, atomically, and
checks them as the kernel does: a rule may only name sets and chains that exist, a jump or goto
to a missing chain fails, an element must have its set's field kinds and types (and an existing
chain in a verdict), an element deleted must be there, re-adding a map key with another value
fails (the kernel's EBUSY/EEXIST), overlapping intervals fail unless the set auto-merges, and
a chain or set still referenced cannot be deleted. `dump()` is a canonical text of its state.

`trace(packet)` walks a packet through the faked tables, hook by hook (prerouting or output,
then input or forward, then postrouting), evaluating our rules' grammar, and returns every
possible outcome (one per random choice: `numgen random mod n`): the verdict (accept, drop,
reject), the DNAT target and whether the packet is masqueraded.
"""

from __future__ import annotations

import copy
import ipaddress
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network

from packet_walk import Walk, every_outcome
from semantics import Outcome, Packet

from kpx_agent.backends.base import BackendError
from kpx_agent.backends.kernel.nft_transaction import (
    AddChain,
    AddElements,
    AddRule,
    AddSet,
    DeleteChain,
    DeleteElements,
    DeleteSet,
    FlushChain,
    Op,
    ReplaceTable,
    TableDef,
    Transaction,
)
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables import netlink_batch
from kpx_agent.backends.nftables.schema import (
    Field,
    Goto,
    Key,
    SetDecl,
    Value,
    ValueKind,
    element_text,
)
from kpx_agent.model.types import IP, Protocol

HOOKS = {
    "prerouting": ("filter", "nat"),
    "output": ("filter", "nat"),
    "input": ("filter",),
    "forward": ("filter",),
    "postrouting": ("nat",),
}


@dataclass
class FakeSet:
    decl: SetDecl
    elements: dict[Key, Value] = field(default_factory=dict)


@dataclass
class FakeChain:
    rules: list[str] = field(default_factory=list)
    hook: tuple[str, str, int] | None = None


@dataclass
class FakeTable:
    family: int
    sets: dict[str, FakeSet] = field(default_factory=dict)
    chains: dict[str, FakeChain] = field(default_factory=dict)


class FakeError(BackendError):
    """What the kernel would refuse; nothing of the transaction is applied."""


class FakeNftables:
    def __init__(self) -> None:
        self.tables: dict[int, FakeTable] = {}
        self.transactions = 0
        # Keys the kernel refuses in any set (a poison element): an address, a port, ...
        self.refuse: set[object] = set()
        # Families whose every transaction the kernel refuses (say, no IPv6 NAT in it).
        self.broken_families: set[int] = set()
        # The ruleset's generation id: every committed transaction or load bumps it (`edit`
        # does for a change made behind the backend's back).
        self.generation = 0

    # -- the backend's kernel interface (NftablesBackend's injectable callables)

    def present_families(self) -> set[int]:
        return set(self.tables)

    def run_transactions(self, transactions: Iterable[Transaction]) -> None:
        staged = copy.deepcopy(self.tables)
        for txn in transactions:
            if txn.family in self.broken_families and txn.ops:
                raise FakeError(f"family {txn.family}: refused (EOPNOTSUPP)")
            for op in txn.ops:
                if isinstance(op, AddElements):
                    self._refused(list(op.pairs))
                _apply(staged, txn.family, op)
        for table in staged.values():
            _check_rules(table)
        self.tables = staged
        self.transactions += 1
        self.generation += 1

    def _refused(self, pairs: Iterable[tuple[Key, Value]]) -> None:
        for key, _ in pairs:
            if self.refuse & set(key):
                raise FakeError(f"element {key!r}: refused (EINVAL)")

    def check_transactions(self, transactions: Iterable[Transaction]) -> str | None:
        """nft --check: what `run_transactions` would say, applying nothing."""
        tables, count = self.tables, self.transactions
        try:
            self.run_transactions(transactions)
        except FakeError as exc:
            return str(exc)
        finally:
            self.tables, self.transactions = tables, count
        return None

    def load_elements(self, elements: netlink_batch.Elements) -> None:
        staged = copy.deepcopy(self.tables)
        for family, sets in elements.items():
            for set_name, pairs in sets.items():
                if not netlink_batch.loadable(set_name):
                    raise FakeError(f"set {set_name}: cannot be loaded over netlink")
                self._refused(pairs)
                _add_elements(_table(staged, family), set_name, list(pairs))
        self.tables = staged
        self.generation += 1

    def flush(self) -> None:
        """Someone flushed the ruleset."""
        self.tables = {}
        self.generation += 1

    def current_generation(self) -> int:
        return self.generation

    def edit(self, change: Callable[[dict[int, FakeTable]], object] = lambda tables: None) -> None:
        """Another writer's transaction: `change` edits the tables (none: a commit elsewhere),
        and the generation moves on."""
        change(self.tables)
        self.generation += 1

    def digest(self, family: int) -> bytes:
        """A digest of one family's table as the backend's drift check reads it: its sets,
        chains and rules, and the elements of the sets the data path does not update."""
        table = self.tables.get(family)
        if table is None:
            return b"absent"
        lines = []
        for name in sorted(table.sets):
            fake = table.sets[name]
            elements = [] if fake.decl.dynamic_timeout else sorted(
                element_text(k, v) for k, v in fake.elements.items()
            )  # fmt: skip
            lines.append(f"set {name} {fake.decl.body(family)} {elements}")
        for name in sorted(table.chains):
            lines.append(f"chain {name} {table.chains[name].hook} {table.chains[name].rules}")
        return "\n".join(lines).encode()

    # -- state

    def dump(self) -> str:
        """A canonical text of every table (sets sorted, elements sorted)."""
        out = []
        for family in sorted(self.tables):
            table = self.tables[family]
            out.append(f"table {n.FAMILIES[family]} {n.TABLE}")
            for name in sorted(table.sets):
                fake = table.sets[name]
                elements = sorted(element_text(k, v) for k, v in fake.elements.items())
                out.append(f"  set {name} {fake.decl.body(family)} {{ {', '.join(elements)} }}")
            for name in sorted(table.chains):
                chain = table.chains[name]
                out.append(f"  chain {name} {chain.hook or ''}")
                out += [f"    {rule}" for rule in chain.rules]
        return "\n".join(out) + "\n"

    def elements(self, family: int, set_name: str) -> dict[Key, Value]:
        return dict(self.tables[family].sets[set_name].elements)

    # -- the tracer

    def trace(self, packet: Packet) -> set[Outcome]:
        """Every outcome of `packet` over all random choices (numgen)."""
        table = self.tables.get(packet.family)
        if table is None:
            return {Outcome("accept")}
        return every_outcome(lambda choices: _Walk(table, packet, choices))


# -- applying operations ---------------------------------------------------------------------------


def _table(tables: dict[int, FakeTable], family: int) -> FakeTable:
    table = tables.get(family)
    if table is None:
        raise FakeError(f"{n.FAMILIES[family]} {n.TABLE}: no such table")
    return table


def _apply(tables: dict[int, FakeTable], family: int, op: Op) -> None:
    if isinstance(op, ReplaceTable):
        tables[family] = _define(op.table)
        return
    table = _table(tables, family)
    match op:
        case AddSet(decl):
            found = table.sets.get(decl.name)
            if found is not None and found.decl != decl:
                raise FakeError(f"set {decl.name} exists with another definition")
            table.sets.setdefault(decl.name, FakeSet(decl))
        case AddChain(name):
            table.chains.setdefault(name, FakeChain())
        case FlushChain(name):
            _chain(table, name).rules.clear()
        case AddRule(chain, rule):
            _chain(table, chain).rules.append(str(rule))
        case DeleteChain(name):
            _chain(table, name)
            if _chain_users(table, name):
                raise FakeError(f"chain {name} is still used (EBUSY)")
            del table.chains[name]
        case DeleteSet(name):
            if name not in table.sets:
                raise FakeError(f"set {name}: no such set (ENOENT)")
            if any(f"@{name}" in rule.split() for c in table.chains.values() for rule in c.rules):
                raise FakeError(f"set {name} is still used by a rule (EBUSY)")
            del table.sets[name]
        case DeleteElements(set_name, keys):
            fake = _set(table, set_name)
            for key in keys:
                if key not in fake.elements:
                    raise FakeError(f"set {set_name}: no element {key} (ENOENT)")
                del fake.elements[key]
        case AddElements(set_name, pairs):
            _add_elements(table, set_name, list(pairs))
        case _:
            raise FakeError(f"unknown operation {op!r}")


def _define(definition: TableDef) -> FakeTable:
    table = FakeTable(definition.family)
    for decl in definition.sets:
        table.sets[decl.name] = FakeSet(decl)
    for chain in definition.chains:
        table.chains[chain.name] = FakeChain([str(r) for r in chain.rules], chain.hook)
    for set_name, keys in definition.elements.items():
        _add_elements(table, set_name, [(k, None) for k in keys])
    return table


def _chain(table: FakeTable, name: str) -> FakeChain:
    chain = table.chains.get(name)
    if chain is None:
        raise FakeError(f"chain {name}: no such chain (ENOENT)")
    return chain


def _set(table: FakeTable, name: str) -> FakeSet:
    found = table.sets.get(name)
    if found is None:
        raise FakeError(f"set {name}: no such set (ENOENT)")
    return found


def _chain_users(table: FakeTable, name: str) -> bool:
    for chain in table.chains.values():
        for rule in chain.rules:
            words = rule.split()
            if any(a in ("jump", "goto") and b == name for a, b in itertools.pairwise(words)):
                return True
    return any(value == Goto(name) for s in table.sets.values() for value in s.elements.values())


def _check_rules(table: FakeTable) -> None:
    """Every set and chain a rule names exists, with the right kind (the kernel resolves them
    when the transaction commits)."""
    for chain_name, chain in table.chains.items():
        for rule in chain.rules:
            words = rule.split()
            for i, word in enumerate(words):
                if word.startswith("@"):
                    found = _set(table, word[1:])
                    if i and words[i - 1] == "vmap" and found.decl.value is not ValueKind.VERDICT:
                        raise FakeError(f"{chain_name}: {word} is not a verdict map")
                    if i and words[i - 1] == "map" and found.decl.value is not ValueKind.ENDPOINT:
                        raise FakeError(f"{chain_name}: {word} is not a data map")
                    # A map looked up as a set: Linux 6.1 (Debian 12's kernel) refuses the
                    # rule with EINVAL, though later kernels accept it.
                    looked_up_as_set = not i or words[i - 1] not in ("vmap", "map")
                    if looked_up_as_set and found.decl.value is not ValueKind.NONE:
                        raise FakeError(f"{chain_name}: {word} is a map, looked up as a set")
                if word in ("jump", "goto"):
                    _chain(table, words[i + 1])


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


def _add_elements(table: FakeTable, set_name: str, pairs: list[tuple[Key, Value]]) -> None:
    fake = _set(table, set_name)
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
            _chain(table, value.chain)
        else:
            ok = type(value) is tuple and len(value) == 2
            if not ok or not all(
                _check_field(family, k, v) for k, v in zip(decl.value_fields, value, strict=True)
            ):
                raise FakeError(f"{shown}: needs an (address, port) value")
        if key in fake.elements:
            if fake.elements[key] != value:
                raise FakeError(f"{shown}: exists with another value (EEXIST)")
            continue
        if decl.interval and not decl.auto_merge:
            for other in fake.elements:
                if other[:-1] == key[:-1] and other[-1].overlaps(key[-1]):  # type: ignore[union-attr]
                    raise FakeError(f"{shown}: overlaps {other!r} (EEXIST)")
        fake.elements[key] = value


# -- the tracer -----------------------------------------------------------------------------------


class _Goto(Exception):
    """A verdict map's element: go to its chain."""

    def __init__(self, chain: str) -> None:
        self.chain = chain


class _Verdict(Exception):
    def __init__(self, verdict: str, chain: str = "") -> None:
        self.verdict, self.chain = verdict, chain


class _Walk(Walk):
    def __init__(self, table: FakeTable, packet: Packet, choices: list[int]) -> None:
        super().__init__(packet, choices)
        self.table = table

    def hook(self, hook: str) -> str:
        chains = [
            (c.hook[2], name)
            for name, c in self.table.chains.items()
            if c.hook is not None and c.hook[1] == hook
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
        for rule in self.table.chains[name].rules:
            try:
                outcome = self.rule(rule.split())
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

    # -- one rule

    def rule(self, words: list[str]) -> tuple[str, str] | None:
        """None: the rule did not match (or matched with no verdict); else (verdict, chain)."""
        w = _Words(words)
        while w:
            word = w.peek()
            if word in ("ip", "ip6", "meta", "th", "numgen") and w.peek(1) != "mark":
                values = self.selectors(w)
                if not self.match_values(w, values):
                    return None
            elif word == "fib":
                w.take(), (which := w.take()), w.take(), w.take()  # fib saddr|daddr type local
                addr = self.packet.saddr if which == "saddr" else self.daddr
                if addr not in self.packet.local_addresses:
                    return None
            elif word == "iifname":
                w.take()
                negate = w.take_if("!=")
                name = w.take().strip('"')
                iif = self.packet.iif
                hit = iif.startswith(name[:-1]) if name.endswith("*") else iif == name
                if hit == negate:
                    return None
            elif word == "ct":
                # Every traced packet is a new connection's first, DNATed or not by now.
                w.take()
                what = w.take()
                negate = w.take_if("!=")
                if w.take_if("&"):  # ct status & dnat == 0
                    flag, _, _ = w.take(), w.take(), w.take()
                    negate, states = True, [flag]
                elif w.take_if("{"):  # ct state != { established, related }
                    states = []
                    while (state := w.take()) != "}":
                        states.append(state.rstrip(","))
                else:
                    states = [w.take()]
                held = {"new"} if what == "state" else {"dnat"} if self.dnat else set()
                if bool(held & set(states)) == negate:
                    return None
            elif word == "meta":  # meta mark ...
                w.take(), w.take()
                if w.take_if("set"):
                    w.take(), w.take()  # meta mark
                    op, mark = w.take(), int(w.take(), 16)
                    self.mark = self.mark | mark if op == "|" else self.mark ^ mark
                else:
                    w.take()  # &
                    mark = int(w.take(), 16)
                    w.take(), w.take()  # == mark
                    if not self.mark & mark:
                        return None
            elif word == "update":
                w.take(), w.take()  # the dynamic set: empty in a fresh trace
                while w.take() != "}":
                    pass
            elif word == "dnat":
                self.do_dnat(w)
                return ("accept", "")
            elif word == "masquerade":
                self.masquerade = True
                return ("accept", "")
            elif word in ("accept", "drop", "reject"):
                return (word, "")
            elif word in ("jump", "goto"):
                w.take()
                return (word, w.take())
            else:
                raise AssertionError(f"the tracer does not know {word!r} in {' '.join(words)}")
        return None

    def selectors(self, w: _Words) -> list[object]:
        values = [self.selector(w)]
        while w.take_if("."):
            values.append(self.selector(w))
        return values

    def selector(self, w: _Words) -> object:
        a, b = w.take(), w.take()
        if (a, b) in (("ip", "daddr"), ("ip6", "daddr")):
            return IP.of(self.daddr)
        if (a, b) in (("ip", "saddr"), ("ip6", "saddr")):
            return IP.of(self.packet.saddr)
        if (a, b) == ("meta", "l4proto"):
            return self.packet.protocol
        if (a, b) == ("th", "dport"):
            return self.dport
        if (a, b) == ("numgen", "random"):
            w.take()  # mod
            return self.choose(int(w.take()))
        raise AssertionError(f"unknown selector {a} {b}")

    def match_values(self, w: _Words, values: list[object]) -> bool:
        """After selectors: `@set`, `!= @set`, `vmap @map` (raises the verdict), `== n`, a
        literal (protocol, network), `!= literal`."""
        negate = w.take_if("!=")
        word = w.take()
        if word == "vmap":
            value = self.lookup(w.take()[1:], values)
            if value is None:
                return False
            assert isinstance(value, Goto)
            raise _Goto(value.chain)
        if word == "==":
            word = w.take()
        if word.startswith("@"):
            hit = self.lookup(word[1:], values, membership=True) is not None
        else:
            (value,) = values
            hit = _literal_match(value, word)
        return hit != negate

    def lookup(self, set_name: str, values: list[object], membership: bool = False) -> object:
        fake = self.table.sets[set_name]
        key = tuple(values)
        if not fake.decl.interval:
            if key in fake.elements:
                found = fake.elements[key]
                return True if membership and found is None else found
            return None
        for element in fake.elements:
            address = ipaddress.ip_address(str(key[-1]))
            if element[:-1] == key[:-1] and address in _hosts(element[-1]):
                return True
        return None

    def do_dnat(self, w: _Words) -> None:
        w.take(), w.take(), w.take()  # dnat ip to
        if w.peek() in ("ip", "ip6", "meta"):
            values = self.selectors(w)
            w.take()  # map
            target = self.lookup(w.take()[1:], values)
            if target is None:
                raise _Verdict("drop")  # no map element: the kernel drops the packet
            ip, port = target  # type: ignore[misc]
        else:
            text = w.take()
            host, _, port_text = text.rpartition(":")
            ip, port = host.strip("[]"), int(port_text)
        self.dnat = (str(ip), int(port))
        self.daddr, self.dport = IP.of(str(ip)), int(port)


def _hosts(net: object) -> IPv4Network | IPv6Network:
    assert isinstance(net, IPv4Network | IPv6Network)
    return net


def _literal_match(value: object, word: str) -> bool:
    if isinstance(value, Protocol):
        return value.value == word
    if isinstance(value, int):
        return value == int(word)
    return ipaddress.ip_address(str(value)) in ipaddress.ip_network(word)


class _Words:
    def __init__(self, words: list[str]) -> None:
        self.words, self.i = words, 0

    def __bool__(self) -> bool:
        return self.i < len(self.words)

    def peek(self, ahead: int = 0) -> str:
        j = self.i + ahead
        return self.words[j] if j < len(self.words) else ""

    def take(self) -> str:
        word = self.words[self.i]
        self.i += 1
        return word

    def take_if(self, word: str) -> bool:
        if self.peek() == word:
            self.i += 1
            return True
        return False


def pairs_of(fake: FakeNftables) -> Iterator[tuple[int, str, int]]:
    """(family, set, element count) of every set, for tests that compare sizes."""
    for family, table in fake.tables.items():
        for name, s in table.sets.items():
            yield family, name, len(s.elements)
