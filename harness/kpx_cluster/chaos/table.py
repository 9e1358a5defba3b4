"""The fault table's pure parts: a row's result, its accounting and its rendering.

`account` splits the load clients' tries between the nodes a fault touches and the others: a
try counts as touched when its client runs on a touched node or its target is a NodePort on a
touched node's address (the packet goes through that node's kernel). `RowResult.problems`
says how a row missed its goal: a failed new connection, a lost UDP exchange or a broken held
connection on an untouched node, a change lost, no convergence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kpx_cluster.migration_load import Summary


@dataclass
class Counts:
    tried: int = 0
    failed: int = 0

    def add(self, tried: int, failed: int) -> None:
        self.tried += tried
        self.failed += failed

    def __str__(self) -> str:
        return f"{self.tried} / {self.failed}"


@dataclass
class Split:
    """Tries on the nodes a fault touches and on the others."""

    touched: Counts = field(default_factory=Counts)
    others: Counts = field(default_factory=Counts)

    def __str__(self) -> str:
        return f"{self.touched} · {self.others}"


@dataclass
class Traffic:
    tcp: Split = field(default_factory=Split)
    udp: Split = field(default_factory=Split)
    #: held connections: (kept, of) on touched nodes' clients and on the others'
    held_touched: Counts = field(default_factory=Counts)
    held_others: Counts = field(default_factory=Counts)
    #: the first failures seen on untouched nodes (client node, seconds, target, reason)
    others_failures: list[str] = field(default_factory=list)


def account(
    loads: Iterable[tuple[str, Summary]],
    touched: Iterable[str],
    node_of_address: Mapping[str, str],
) -> Traffic:
    """`loads`: (client's node, its summary); `node_of_address`: node address -> node name.
    Held connections count in `Counts.tried` (how many) and `Counts.failed` (how many broke)."""
    hit = set(touched)
    out = Traffic()
    for node, summary in loads:
        for kind in ("tcp", "udp"):
            tries = getattr(summary, kind)
            split: Split = getattr(out, kind)
            for target, (tried, failed) in tries.targets.items():
                host = target.rpartition(":")[0].strip("[]")
                on_touched = node in hit or node_of_address.get(host) in hit
                (split.touched if on_touched else split.others).add(tried, failed)
            if node not in hit:
                out.others_failures += [
                    f"{node} {kind} +{at}s {target} {reason}"
                    for at, target, reason in tries.failures
                    if node_of_address.get(target.rpartition(":")[0].strip("[]")) not in hit
                ][:3]
        held = out.held_touched if node in hit else out.held_others
        held.add(len(summary.held), len(summary.held) - summary.held_survived)
    return out


@dataclass
class RowResult:
    name: str
    how: str
    #: which nodes the fault touches ("none": the control plane only; "all")
    touches: str
    traffic: Traffic | None = None
    #: seconds from the heal until every change and every Service answered on every node
    converged: float | None = None
    changes: int = 0
    #: (change, node) pairs that never answered
    lost: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: why the row is not built ("" when it is)
    not_built: str = ""
    #: the row could not run to its end (an exception in the harness)
    error: str = ""
    #: the goal for touched nodes too (faults that must not break any traffic)
    strict: bool = False

    def problems(self) -> list[str]:
        if self.not_built:
            return []
        out = [f"harness error: {self.error}"] if self.error else []
        t = self.traffic
        if t is not None:
            splits = [("others", t.tcp.others, t.udp.others, t.held_others)]
            if self.strict:
                splits.append(("touched", t.tcp.touched, t.udp.touched, t.held_touched))
            for where, tcp, udp, held in splits:
                if tcp.failed:
                    out.append(f"{tcp.failed} of {tcp.tried} new TCP connections failed ({where})")
                if udp.failed:
                    out.append(f"{udp.failed} of {udp.tried} UDP exchanges lost ({where})")
                if held.failed:
                    out.append(f"{held.failed} of {held.tried} held connections broke ({where})")
        elif not self.error:
            out.append("no traffic measured")
        if self.lost:
            out.append(f"{len(self.lost)} changes lost: {', '.join(self.lost[:5])}")
        if self.converged is None and not self.error:
            out.append("did not converge")
        return out

    @property
    def verdict(self) -> str:
        if self.not_built:
            return "not built"
        return "FAIL" if self.problems() else "pass"


TABLE_HEAD = (
    "| fault | injected by | touches | new TCP tried / failed (touched · others) "
    "| UDP tried / lost (touched · others) | held kept (touched · others) | converged (s) "
    "| changes lost | goal |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def _held(c: Counts) -> str:
    return f"{c.tried - c.failed} of {c.tried}"


def table_row(r: RowResult) -> str:
    if r.not_built:
        return f"| {r.name} | not built: {r.not_built} | | | | | | | not built |"
    t = r.traffic
    tcp, udp = (str(t.tcp), str(t.udp)) if t else ("-", "-")
    held = f"{_held(t.held_touched)} · {_held(t.held_others)}" if t else "-"
    conv = f"{r.converged:.1f}" if r.converged is not None else "never"
    lost = f"{len(r.lost)} of {r.changes}"
    return (
        f"| {r.name} | {r.how} | {r.touches} | {tcp} | {udp} | {held} | {conv} | {lost} "
        f"| {r.verdict} |"
    )


def render(rows: Sequence[RowResult]) -> str:
    return "\n".join([TABLE_HEAD, *(table_row(r) for r in rows)])


def details(rows: Sequence[RowResult]) -> list[str]:
    """Per row: its notes, and how it missed its goal."""
    out: list[str] = []
    for r in rows:
        if r.not_built:
            continue
        lines = [f"  - {n}" for n in r.notes]
        lines += [f"  - goal missed: {p}" for p in r.problems()]
        if r.traffic is not None:
            lines += [f"  - failure on an untouched node: {f}" for f in r.traffic.others_failures]
        if lines:
            out += [f"- {r.name}:", *lines]
    return out


def exit_status(rows: Sequence[RowResult]) -> int:
    return 1 if any(r.problems() for r in rows) else 0
