"""One nftables transaction on one family's table, as typed operations, and its nft text (pure).

A mode builds a `Transaction` (the nftables mode's syncs, the ipvs mode's helper table); each
operation is one of the `Op` classes below, holding typed values (a `SetDecl`, a `Rule`,
element keys and pairs, a `TableDef`). `render` serializes them for `nft -f`, the only place
they become text, called by the node's kernels (`nftables.kernel.NodeKernel`, `ipvs.kernel`);
the kernel fakes (`nft_fake`, beneath `nftables.fake` and `ipvs.fake`) apply the same
operations as they are.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .names import NFT_FAMILIES
from .nft_rules import Rule, rule_text
from .nft_schema import Key, Pair, SetDecl, elements_text, key_text


@dataclass(frozen=True)
class ChainSpec:
    """A chain of a fixed table: base chains have a hook (type, hook, priority)."""

    name: str
    rules: tuple[Rule, ...]
    hook: tuple[str, str, int] | None = None  # (type, hook, priority); policy accept


@dataclass(frozen=True)
class TableDef:
    """A family's table: its sets (with the elements given at definition) and its chains."""

    family: int
    sets: tuple[SetDecl, ...]
    elements: Mapping[str, tuple[Key, ...]]
    chains: tuple[ChainSpec, ...]
    comment: str = ""


@dataclass(frozen=True, slots=True)
class ReplaceTable:
    """Swap the whole table atomically (create-if-missing, delete, define)."""

    table: TableDef


@dataclass(frozen=True)
class TableContents:
    """What a table in the kernel holds, by name (listed before its contents are swapped in
    place): its chains with the comment of each of their rules ("" for none), its sets, its
    maps."""

    chains: Mapping[str, tuple[str, ...]]
    sets: tuple[str, ...]
    maps: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RedefineTable:
    """Swap the contents of an existing table atomically, in place: every set and map it
    holds (`contents`) is emptied, every chain flushed except those `kept` (their rules stay
    as they are), the chains and sets `dropped_*` deleted, then `table` is defined over what
    is left (what the rest of the transaction does not define again, it deletes at its end:
    `Transaction.delete_others`). The kernel refuses the whole transaction if a set kept is
    declared otherwise now, or a base chain hooked otherwise.

    Why in place: a set or map created in a transaction can miss lookups for a moment around
    the commit (interval sets, rbtree and pipapo, about once per swap under a flood of new
    flows; the endpoint maps now and then, on kernel 6.18:
    bench/results/2026-11-29-swap-in-place.md), so deleting and creating the table drops
    packets at each swap; sets and maps emptied and refilled in a transaction do not. The
    nftables mode keeps its endpoint chains because nft (1.0.6) cannot add a rule naming a
    `typeof` map that was already in the kernel (`nftables.in_place`)."""

    table: TableDef
    contents: TableContents
    kept: frozenset[str] = frozenset()
    dropped_chains: tuple[str, ...] = ()
    dropped_sets: tuple[str, ...] = ()
    #: sets not emptied: the data path fills them (session affinity), and the new contents
    #: declare them again as they are (or the rest of the transaction deletes them)
    kept_sets: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AddSet:
    decl: SetDecl


@dataclass(frozen=True, slots=True)
class DeleteSet:
    name: str


@dataclass(frozen=True, slots=True)
class AddChain:
    name: str


@dataclass(frozen=True, slots=True)
class FlushChain:
    name: str


@dataclass(frozen=True, slots=True)
class DeleteChain:
    name: str


@dataclass(frozen=True, slots=True)
class AddRule:
    chain: str
    rule: Rule


@dataclass(frozen=True, slots=True)
class AddElements:
    set_name: str
    pairs: tuple[Pair, ...]


@dataclass(frozen=True, slots=True)
class DeleteElements:
    set_name: str
    keys: tuple[Key, ...]


Op = (
    ReplaceTable
    | RedefineTable
    | AddSet
    | DeleteSet
    | AddChain
    | FlushChain
    | DeleteChain
    | AddRule
    | AddElements
    | DeleteElements
)


class Transaction:
    """Operations on one family's table `table`, applied in order as one atomic transaction."""

    def __init__(self, family: int, table: str) -> None:
        self.family = family
        self.table = table
        self.prefix = f"{NFT_FAMILIES[family]} {table}"
        self.ops: list[Op] = []

    def __bool__(self) -> bool:
        return bool(self.ops)

    def replace_table(self, table: TableDef) -> None:
        """Swap the whole table atomically (create-if-missing, delete, define)."""
        self.ops.append(ReplaceTable(table))

    def redefine_table(self, redefine: RedefineTable) -> None:
        """Swap the contents of the existing table atomically, in place (`RedefineTable`)."""
        self.ops.append(redefine)

    def add_endpoint_chain(self, name: str, endpoint_map: SetDecl, rule: Rule) -> None:
        """Create a new chain with its own map, used by its one rule (never rewritten)."""
        self.ops += [AddSet(endpoint_map), AddChain(name), AddRule(name, rule)]

    def add_port_chain(self, name: str, sets: Iterable[SetDecl], rules: Iterable[Rule]) -> None:
        """Create (or rewrite) a chain owned by one service port, with the sets it uses."""
        self.ops += [AddSet(decl) for decl in sets]
        self.ops += [AddChain(name), FlushChain(name)]
        self.ops += [AddRule(name, rule) for rule in rules]

    def delete_chain(self, name: str) -> None:
        self.ops += [FlushChain(name), DeleteChain(name)]

    def delete_set(self, name: str) -> None:
        self.ops.append(DeleteSet(name))

    def delete_others(self, contents: TableContents, keep: Collection[str]) -> None:
        """Delete what `contents` lists and `keep` does not: the chains first (a chain's
        rules may name a set), then the sets and maps (the end of a swap in place, whose
        start emptied every map that named a chain)."""
        for name in contents.chains:
            if name not in keep:
                self.delete_chain(name)
        for name in (*contents.sets, *contents.maps):
            if name not in keep:
                self.delete_set(name)

    def delete_elements(self, set_name: str, keys: Iterable[Key]) -> None:
        found = tuple(keys)
        if found:
            self.ops.append(DeleteElements(set_name, found))

    def add_elements(self, set_name: str, elements: Iterable[Pair]) -> None:
        pairs = tuple(elements)
        if pairs:
            self.ops.append(AddElements(set_name, pairs))

    def render(self) -> str:
        """The nft text of the transaction."""
        lines = [self._line(op) for op in self.ops]
        return "\n".join(lines) + "\n" if lines else ""

    def _line(self, op: Op) -> str:
        prefix = self.prefix
        match op:
            case AddElements(set_name, pairs):
                return f"add element {prefix} {set_name} {{ {elements_text(pairs)} }}"
            case DeleteElements(set_name, keys):
                body = ", ".join(key_text(k) for k in keys)
                return f"delete element {prefix} {set_name} {{ {body} }}"
            case AddSet(decl):
                kind = "map" if decl.is_map else "set"
                return f"add {kind} {prefix} {decl.name} {{ {decl.body(self.family)} }}"
            case AddRule(chain, rule):
                return f"add rule {prefix} {chain} {rule_text(rule)}"
            case AddChain(name):
                return f"add chain {prefix} {name}"
            case FlushChain(name):
                return f"flush chain {prefix} {name}"
            case DeleteChain(name):
                return f"delete chain {prefix} {name}"
            case DeleteSet(name):
                return f"delete set {prefix} {name}"
            case ReplaceTable(table):
                return f"add table {prefix}\ndelete table {prefix}\n" + table_text(
                    table, self.table
                )
            case RedefineTable(table, contents, kept, dropped_chains, dropped_sets, kept_sets):
                lines = [f"add table {prefix}"]
                lines += [f"flush map {prefix} {name}" for name in contents.maps]
                lines += [
                    f"flush set {prefix} {name}" for name in contents.sets if name not in kept_sets
                ]
                lines += [f"flush chain {prefix} {c}" for c in contents.chains if c not in kept]
                lines += [f"delete set {prefix} {name}" for name in dropped_sets]
                lines += [f"delete chain {prefix} {name}" for name in dropped_chains]
                return "\n".join(lines) + "\n" + table_text(table, self.table)
        raise TypeError(f"not an nftables operation: {op!r}")


def table_text(table: TableDef, name: str) -> str:
    """A table definition as nft reads it (`table ip <name> { ... }`)."""
    family = table.family
    lines = [f"table {NFT_FAMILIES[family]} {name} {{"]
    if table.comment:
        lines.append(f'  comment "{table.comment}"')
    for decl in table.sets:
        kind = "map" if decl.is_map else "set"
        elements = table.elements.get(decl.name)
        clause = ""
        if elements is not None:
            clause = (
                f" elements = {{ {', '.join(key_text(k) for k in elements)} }};" if elements else ""
            )
        lines.append(f"  {kind} {decl.name} {{ {decl.body(family)}{clause} }}")
    for chain in table.chains:
        if chain.hook is None:
            lines += [
                f"  chain {chain.name} {{",
                *(f"    {rule_text(r)}" for r in chain.rules),
                "  }",
            ]
            continue
        kind, hook, priority = chain.hook
        head = f"type {kind} hook {hook} priority {priority}; policy accept;"
        if len(chain.rules) == 1:
            lines.append(f"  chain {chain.name} {{ {head} {rule_text(chain.rules[0])}; }}")
        else:
            lines += [
                f"  chain {chain.name} {{",
                f"    {head}",
                *(f"    {rule_text(r)}" for r in chain.rules),
                "  }",
            ]
    lines.append("}")
    return "\n".join(lines)
