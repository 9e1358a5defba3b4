"""One nftables transaction as typed operations, and its nft text (pure).

The backend builds `Transaction`s; `render` serializes them for `nft -f`, and the kernel fake
in the tests applies the same operations. Elements and rules stay typed until they are
rendered (rules by `rules.rule_text`, elements by `schema.elements_text`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from . import names as n
from .rules import Rule, rule_text
from .ruleset import TableDef
from .schema import Key, Pair, SetDecl, elements_text, key_text


class Op(NamedTuple):
    """One operation: `kind` names it, `args` are typed values (see Transaction's methods)."""

    kind: str
    args: tuple[object, ...]


class Transaction:
    """Operations on one family's table, applied in order as one atomic transaction."""

    def __init__(self, family: int) -> None:
        self.family = family
        self.prefix = f"{n.FAMILIES[family]} {n.TABLE}"
        self.ops: list[Op] = []

    def __bool__(self) -> bool:
        return bool(self.ops)

    def replace_table(self, table: TableDef) -> None:
        """Swap the whole table atomically (create-if-missing, delete, define)."""
        self.ops.append(Op("replace_table", (table,)))

    def add_endpoint_chain(self, name: str, endpoint_map: SetDecl, rule: Rule) -> None:
        """Create a new chain with its own map, used by its one rule (never rewritten)."""
        self.ops.append(Op("add_set", (endpoint_map,)))
        self.ops.append(Op("add_chain", (name,)))
        self.ops.append(Op("add_rule", (name, rule)))

    def add_port_chain(self, name: str, sets: Iterable[SetDecl], rules: Iterable[Rule]) -> None:
        """Create (or rewrite) a chain owned by one service port, with the sets it uses."""
        for decl in sets:
            self.ops.append(Op("add_set", (decl,)))
        self.ops.append(Op("add_chain", (name,)))
        self.ops.append(Op("flush_chain", (name,)))
        for rule in rules:
            self.ops.append(Op("add_rule", (name, rule)))

    def delete_chain(self, name: str) -> None:
        self.ops.append(Op("flush_chain", (name,)))
        self.ops.append(Op("delete_chain", (name,)))

    def delete_set(self, name: str) -> None:
        self.ops.append(Op("delete_set", (name,)))

    def delete_elements(self, set_name: str, keys: Iterable[Key]) -> None:
        keys = list(keys)
        if keys:
            self.ops.append(Op("delete_elements", (set_name, keys)))

    def add_elements(self, set_name: str, elements: Iterable[Pair]) -> None:
        pairs = list(elements)
        if pairs:
            self.ops.append(Op("add_elements", (set_name, pairs)))

    def render(self) -> str:
        """The nft text of the transaction."""
        lines = [_line(self.prefix, self.family, op) for op in self.ops]
        return "\n".join(lines) + "\n" if lines else ""


def _line(prefix: str, family: int, op: Op) -> str:
    kind, args = op
    if kind == "add_elements":
        set_name, pairs = args
        return f"add element {prefix} {set_name} {{ {elements_text(pairs)} }}"  # type: ignore[arg-type]
    if kind == "delete_elements":
        set_name, keys = args
        body = ", ".join(key_text(k) for k in keys)  # type: ignore[attr-defined]
        return f"delete element {prefix} {set_name} {{ {body} }}"
    if kind == "add_set":
        (decl,) = args
        assert isinstance(decl, SetDecl)
        return (
            f"add {'map' if decl.is_map else 'set'} {prefix} {decl.name} {{ {decl.body(family)} }}"
        )
    if kind == "add_rule":
        chain, rule = args
        assert isinstance(rule, Rule)
        return f"add rule {prefix} {chain} {rule_text(rule)}"
    if kind in ("add_chain", "flush_chain", "delete_chain", "delete_set"):
        verb, what = kind.split("_")
        return f"{verb} {what} {prefix} {args[0]}"
    if kind == "replace_table":
        return f"add table {prefix}\ndelete table {prefix}\n" + table_text(args[0])  # type: ignore[arg-type]
    raise ValueError(f"unknown operation {kind}")


def table_text(table: TableDef) -> str:
    """A table definition as nft reads it (`table ip kpx { ... }`)."""
    family = table.family
    lines = [f"table {n.FAMILIES[family]} {n.TABLE} {{"]
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
