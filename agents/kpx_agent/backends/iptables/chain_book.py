"""The backend's own record of the chains it programmed in one family, and who owns them.

Every KPX chain is in here with the exact rules we wrote (as written: `rules.Lines`; the
typed rules of a sync are serialized on their way in): the fixed chains, the shared chains
(head, then each owner's rules in key order with duplicates written once, then tail), and the
chains each service port owns. A change is planned against the record without touching it:
the plan names only the chains whose content differs, so a sync sends those and nothing else,
and never reads the kernel back. The plan is committed once the kernel accepted it, so a
refused restore leaves the record equal to what the kernel still has.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...model.types import ServicePortKey
from .rules import ChainId, Lines, PortLines, Rules, chain_lines


@dataclass
class ChainPlan:
    """What one sync changes: chain contents to write (None: delete the chain)."""

    changes: dict[ChainId, Lines | None] = field(default_factory=dict)
    _contrib: dict[ServicePortKey, PortLines | None] = field(default_factory=dict)
    _parts: dict[ChainId, dict[ServicePortKey, Lines | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def tables(self) -> list[str]:
        return sorted({table for table, _ in self.changes})

    def table_changes(self, table: str) -> dict[str, Lines | None]:
        return {chain: rules for (t, chain), rules in self.changes.items() if t == table}


class ChainBook:
    def __init__(
        self,
        fixed: Mapping[ChainId, Rules],
        frames: Mapping[ChainId, tuple[Rules, Rules]],
    ) -> None:
        self._frames = {
            cid: (tuple(r.text for r in head), tuple(r.text for r in tail))
            for cid, (head, tail) in frames.items()
        }
        self._contrib: dict[ServicePortKey, PortLines] = {}
        self._parts: dict[ChainId, dict[ServicePortKey, Lines]] = {cid: {} for cid in frames}
        self.chains: dict[ChainId, Lines] = chain_lines(fixed)
        for cid, (head, tail) in self._frames.items():
            self.chains[cid] = head + tail

    def __len__(self) -> int:
        """Number of chains."""
        return len(self.chains)

    def rule_count(self) -> int:
        return sum(len(rules) for rules in self.chains.values())

    def owners(self) -> list[ServicePortKey]:
        return list(self._contrib)

    def table_chains(self, table: str) -> dict[str, Lines]:
        return {chain: rules for (t, chain), rules in self.chains.items() if t == table}

    def _compose(self, cid: ChainId, parts: Mapping[ServicePortKey, Lines]) -> Lines:
        head, tail = self._frames[cid]
        # A rule two owners both want (a shared hairpin address) is written once.
        body = dict.fromkeys(rule for key in sorted(parts) for rule in parts[key])
        return (*head, *body, *tail)

    def plan(self, updates: Mapping[ServicePortKey, PortLines | None]) -> ChainPlan:
        """The chains that change if each service port's rules become `updates[key]`."""
        plan = ChainPlan()
        for key, new in updates.items():
            old = self._contrib.get(key)
            if old == new:
                continue
            plan._contrib[key] = new
            old_own = old.own if old is not None else {}
            new_own = new.own if new is not None else {}
            for cid in old_own.keys() - new_own.keys():
                plan.changes[cid] = None
            for cid, rules in new_own.items():
                if old_own.get(cid) != rules:
                    plan.changes[cid] = rules
            old_shared = old.shared if old is not None else {}
            new_shared = new.shared if new is not None else {}
            for cid in old_shared.keys() | new_shared.keys():
                if old_shared.get(cid) != new_shared.get(cid):
                    plan._parts.setdefault(cid, {})[key] = new_shared.get(cid)
        for cid, overlay in plan._parts.items():
            parts = dict(self._parts[cid])
            for key, part in overlay.items():
                if part:
                    parts[key] = part
                else:
                    parts.pop(key, None)
            composed = self._compose(cid, parts)
            if composed != self.chains.get(cid):
                plan.changes[cid] = composed
        return plan

    def commit(self, plan: ChainPlan) -> None:
        """Record a plan the kernel accepted."""
        for cid, rules in plan.changes.items():
            if rules is None:
                self.chains.pop(cid, None)
            else:
                self.chains[cid] = rules
        for cid, overlay in plan._parts.items():
            parts = self._parts[cid]
            for key, part in overlay.items():
                if part:
                    parts[key] = part
                else:
                    parts.pop(key, None)
        for key, contrib in plan._contrib.items():
            if contrib is None:
                self._contrib.pop(key, None)
            else:
                self._contrib[key] = contrib

    def revert(self, plan: ChainPlan, table: str) -> dict[str, Lines | None]:
        """The changes that undo `plan` in `table` (it was applied, not committed)."""
        return {chain: self.chains.get((t, chain)) for (t, chain) in plan.changes if t == table}
