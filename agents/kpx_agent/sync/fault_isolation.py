"""Which Services make the kernel refuse a ruleset: a search by bisection, pure.

When the kernel refuses a sync, the proxier asks the backend's check mode (`Backend.check`:
the kernel validates a whole ruleset and applies nothing) about parts of the state, to find
the Services without which the rest is accepted. Those are left out and reported; the rest is
programmed. Nothing programmed changes while searching.

The search keeps a list of Services known to be accepted together (`good`, first those the
kernel already holds) and adds the others a group at a time: a group accepted with them joins
them, a refused group is split in two halves, searched in turn, down to single Services, which
are the culprits. A culprit is then a Service refused on its own or with those before it (of
two Services the kernel refuses together, the later one in the order given): k culprits among n
Services cost about 2 k log2(n) checks, and one check when nothing is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")


@dataclass
class Search(Generic[Item]):
    """The outcome: the items refused, with the kernel's reason for each, and the checks
    made. `isolated` is False when the search could not decide (the known-good part alone
    was refused, or the budget of checks ran out): then nothing is to be left out."""

    culprits: dict[Item, str] = field(default_factory=dict)
    checks: int = 0
    isolated: bool = True


class _Budget(Exception):
    pass


def find_culprits(
    items: Sequence[Item],
    check: Callable[[Sequence[Item]], str | None],
    good: Sequence[Item] = (),
    max_checks: int = 200,
) -> Search[Item]:
    """The items without which `check(good + accepted)` is accepted. `check(included)` says
    None when the kernel accepts exactly the `included` items, or the kernel's reason."""
    search: Search[Item] = Search()
    accepted = list(good)

    def ask(included: list[Item]) -> str | None:
        if search.checks >= max_checks:
            raise _Budget
        search.checks += 1
        return check(included)

    def narrow(group: list[Item]) -> None:
        reason = ask(accepted + group)
        if reason is None:
            accepted.extend(group)
        elif len(group) == 1:
            search.culprits[group[0]] = reason
        else:
            middle = len(group) // 2
            narrow(group[:middle])
            narrow(group[middle:])

    try:
        if ask(accepted) is not None:
            return Search(checks=search.checks, isolated=False)
        if items:
            narrow(list(items))
    except _Budget:
        return Search(checks=search.checks, isolated=False)
    return search
