"""What a full sync over a table already in the kernel keeps, empties and deletes (pure).

A full sync swaps an existing table's contents in place (`nft_transaction.RedefineTable`):
every set and map is emptied and filled again, every chain flushed and written again, and
what the new contents do not hold is deleted at the end of the same transaction. The
endpoint chains (`endpoints-<n>` and the like, each with its own `typeof` map of the same
name) are the exception: one holding exactly the one rule this version writes into it (its
comment is a digest of the rule and of its map's declaration), with its map, is kept as it
is (nft 1.0.6 cannot add a rule naming a `typeof` map already in the kernel, and a map
created anew can miss lookups around the commit); one holding anything else (changed behind
the agent's back, or written by another version) is deleted with its map, and made again by
the transaction if the new contents have it. The session affinity sets are not emptied:
they hold which endpoint each client was sent to, and keep it across the swap.
"""

from __future__ import annotations

from collections.abc import Callable

from ..kernel.nft_rules import Rule
from ..kernel.nft_transaction import (
    AddChain,
    AddSet,
    RedefineTable,
    ReplaceTable,
    TableContents,
    TableDef,
    Transaction,
)
from . import names as n


def in_place(
    table: TableDef, contents: TableContents, endpoint_rule: Callable[[str], Rule]
) -> RedefineTable:
    """The swap in place of the table holding `contents` for one defined as `table`;
    `endpoint_rule(name)`: the rule this version writes into the endpoint chain `name`."""
    maps = set(contents.maps)
    kept: set[str] = set()
    dropped_chains: list[str] = []
    dropped_sets: list[str] = []
    for name, comments in contents.chains.items():
        if n.endpoint_count_of(name) is None:
            continue
        if name in maps and comments == (endpoint_rule(name).comment,):
            kept.add(name)
            continue
        dropped_chains.append(name)
        if name in maps or name in contents.sets:
            dropped_sets.append(name)
    for name in (*contents.sets, *contents.maps):
        # an endpoint map without its chain: made again (if at all) with a new chain
        if n.endpoint_count_of(name) is not None and name not in contents.chains:
            dropped_sets.append(name)
    # The affinity sets: their elements are the clients' affinity, which a restart keeps (as
    # upstream's does); the transaction deletes those the new contents do not declare.
    kept_sets = frozenset(name for name in contents.sets if n.is_affinity_set(name))
    return RedefineTable(
        table,
        contents,
        frozenset(kept),
        tuple(dropped_chains),
        tuple(dropped_sets),
        kept_sets,
    )


def defined_names(txn: Transaction) -> set[str]:
    """The chains and sets a transaction part defines (or defines again)."""
    names: set[str] = set()
    for op in txn.ops:
        match op:
            case ReplaceTable(table) | RedefineTable(table):
                names.update(decl.name for decl in table.sets)
                names.update(chain.name for chain in table.chains)
            case AddSet(decl):
                names.add(decl.name)
            case AddChain(name):
                names.add(name)
    return names


def leftovers(
    family: int, contents: TableContents, redefine: RedefineTable, defined: set[str]
) -> Transaction:
    """The last part of a swap in place: what the kernel held (`contents`) and neither the
    swap dropped nor the new contents define (`defined`) is deleted."""
    txn = Transaction(family, n.TABLE)
    dropped = {*redefine.dropped_chains, *redefine.dropped_sets}
    txn.delete_others(contents, dropped | defined)
    return txn
