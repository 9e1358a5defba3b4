"""The nftables backend's kernel, faked (as sigs.k8s.io/knftables ships `Fake`; our own code).

`FakeNftables` applies the typed transactions (`nft_transaction.Transaction`) and element loads
the backend sends, atomically, and checks them as the kernel does (`kernel.nft_fake`: a rule
may only name sets and chains that exist, a jump or goto to a missing chain fails, an element
must have its set's field kinds and types, and an existing chain in a verdict, an element
deleted must be there, re-adding a map key with another value fails (the kernel's
EBUSY/EEXIST), overlapping intervals fail unless the set auto-merges, and a chain or set still
referenced cannot be deleted). Rules are kept as the typed `Rule`s production builds.
`dump()` is a canonical text of its state.

`trace(packet)` walks a packet through the faked tables, hook by hook (prerouting or output,
then input or forward, then postrouting), evaluating the rules' typed statements
(`kernel.nft_fake.NftWalk`), and returns every possible outcome (one per random choice:
`numgen random mod n`): the verdict (accept, drop, reject), the DNAT target and whether the
packet is masqueraded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator

from ..kernel.nft_fake import (
    FakeChain,
    FakeError,
    FakeSet,
    FakeTable,
    NftWalk,
    add_elements,
    check_rules,
    contents_of,
)
from ..kernel.nft_fake import apply as apply_op
from ..kernel.nft_query import Overtaken
from ..kernel.nft_transaction import AddElements, TableContents, Transaction
from ..kernel.packet_walk import Outcome, Packet, every_outcome
from . import names as n
from . import netlink_batch
from .schema import Key, Value, element_text

__all__ = [
    "FakeChain",
    "FakeError",
    "FakeNftables",
    "FakeSet",
    "FakeTable",
    "NftScripts",
    "pairs_of",
]


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
        self.generation_id = 0
        # Families whose table cannot be listed (a full sync then replaces it whole).
        self.unlistable: set[int] = set()

    # -- the backend's kernel (`kernel.Kernel`)

    def run(self, transactions: Iterable[Transaction]) -> None:
        self.run_transactions(transactions)

    def check(self, transactions: Iterable[Transaction]) -> str | None:
        return self.check_transactions(transactions)

    def generation(self) -> int:
        return self.generation_id

    def table_digest(self, family: int, still: Callable[[], bool] | None = None) -> bytes:
        if still is not None and not still():
            raise Overtaken()
        return self.digest(family)

    def present_families(self) -> set[int]:
        return set(self.tables)

    def table_contents(self, family: int) -> TableContents | None:
        table = self.tables.get(family)
        if table is None or family in self.unlistable:
            return None
        return contents_of(table)

    def run_transactions(self, transactions: Iterable[Transaction]) -> None:
        staged = copy.deepcopy(self.tables)
        for txn in transactions:
            if txn.family in self.broken_families and txn.ops:
                raise FakeError(f"family {txn.family}: refused (EOPNOTSUPP)")
            for op in txn.ops:
                if isinstance(op, AddElements):
                    self._refused(list(op.pairs))
                apply_op(staged, txn.family, op, n.TABLE)
        for table in staged.values():
            check_rules(table)
        self.tables = staged
        self.transactions += 1
        self.generation_id += 1

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
                pairs = list(pairs)  # (an iterable, maybe made as it is consumed)
                self._refused(pairs)
                add_elements(_table(staged, family), set_name, pairs)
        self.tables = staged
        self.generation_id += 1

    def flush(self) -> None:
        """Someone flushed the ruleset."""
        self.tables = {}
        self.generation_id += 1

    def edit(self, change: Callable[[dict[int, FakeTable]], object] = lambda tables: None) -> None:
        """Another writer's transaction: `change` edits the tables (none: a commit elsewhere),
        and the generation moves on."""
        change(self.tables)
        self.generation_id += 1

    def digest(self, family: int) -> bytes:
        """A digest of one family's table as the backend's drift check reads it: its sets,
        chains and rules, and the elements of the sets the data path does not update."""
        table = self.tables.get(family)
        if table is None:
            return b"absent"
        lines = []
        for name in sorted(table.sets):
            fake = table.sets[name]
            elements = (
                []
                if fake.decl.dynamic_timeout
                else sorted(element_text(k, v) for k, v in fake.elements.items())
            )
            lines.append(f"set {name} {fake.decl.body(family)} {elements}")
        for name in sorted(table.chains):
            chain = table.chains[name]
            lines.append(f"chain {name} {chain.hook} {[str(r) for r in chain.rules]}")
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
        return every_outcome(lambda choices: NftWalk(table, packet, choices))


def _table(tables: dict[int, FakeTable], family: int) -> FakeTable:
    table = tables.get(family)
    if table is None:
        raise FakeError(f"{n.FAMILIES[family]} {n.TABLE}: no such table")
    return table


def pairs_of(fake: FakeNftables) -> Iterator[tuple[int, str, int]]:
    """(family, set, element count) of every set, for tests that compare sizes."""
    for family, table in fake.tables.items():
        for name, s in table.sets.items():
            yield family, name, len(s.elements)


class NftScripts:
    """A `kernel.Kernel` that applies nothing and records the nft text of each run, as
    `kernel.NodeKernel` would hand it to `nft -f` (golden tests, benchmarks). Its `families`
    are present, so a full sync swaps each table in one transaction; the elements loaded over
    netlink (none then) are recorded too."""

    def __init__(self, families: Iterable[int] = (4, 6)) -> None:
        self.families = set(families)
        self.runs: list[str] = []
        self.loaded: list[netlink_batch.Elements] = []

    def run(self, transactions: Iterable[Transaction]) -> None:
        self.runs.append("".join(txn.render() for txn in transactions))

    def check(self, transactions: Iterable[Transaction]) -> str | None:
        for txn in transactions:
            txn.render()
        return None

    def present_families(self) -> set[int]:
        return set(self.families)

    def load_elements(self, elements: netlink_batch.Elements) -> None:
        self.loaded.append({f: {k: list(v) for k, v in s.items()} for f, s in elements.items()})

    def generation(self) -> int:
        return len(self.runs) + len(self.loaded)

    def table_digest(self, family: int, still: Callable[[], bool] | None = None) -> bytes:
        return b""

    def table_contents(self, family: int) -> TableContents | None:
        return None  # a full sync replaces each table whole: the text golden files hold
