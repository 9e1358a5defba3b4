"""What one partial sync may program (pure).

A change to one big Service (many ports, thousands of endpoints each) would otherwise be
programmed in one kernel transaction that holds up every other change on the node for
seconds. A partial sync takes the ports it changes cheapest first, up to MAX_SYNC_COST
endpoints in all (always at least one port), and leaves the rest to the syncs that follow at
once; small changes recorded meanwhile join the next sync and go first. The unit is a Service
port in one IP family: one port is never split, so a change costs at most one port's
endpoints (quarantine.py caps a whole Service at 100,000) beyond the budget. Full syncs are not
split: they replace the whole ruleset in one transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final, TypeVar

#: Endpoints one partial sync programs at most (summed over the Service ports it changes):
#: about half a second of nftables work on a 2-core machine (bench/results/sync_budget.md).
MAX_SYNC_COST: Final = 20_000

K = TypeVar("K")


def split_by_budget(
    keys: Collection[K], cost_of: Callable[[K], int], budget: int = MAX_SYNC_COST
) -> tuple[set[K], set[K]]:
    """(the keys to program now, the keys left for the next syncs): the cheapest first
    (ties in the keys' order as strings, so every node splits alike) while their costs add up
    to at most `budget`, and at least one key."""
    costs = {k: max(1, cost_of(k)) for k in keys}
    if sum(costs.values()) <= budget:
        return set(keys), set()
    now: set[K] = set()
    spent = 0
    for key in sorted(keys, key=lambda k: (costs[k], str(k))):
        if now and spent + costs[key] > budget:
            break
        now.add(key)
        spent += costs[key]
    return now, set(keys) - now
