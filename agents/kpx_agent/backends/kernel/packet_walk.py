"""The packet tracer the kernel fakes share (`nftables.fake`, `iptables.fake`, `ipvs.fake`): a
packet, its outcome, its path through netfilter's hooks, and the enumeration of every random
choice it meets.

A `Walk` is one pass of one packet with fixed answers to the random numbers it meets
(`numgen random mod n`, `-m statistic`): it goes through prerouting, then input (the
destination is one of the node's addresses: delivered, no postrouting) or forward, then
postrouting; a packet the node sends goes through output, then postrouting. Each fake says
what one hook does to the packet (`hook`: its verdict, with the DNAT and masquerade it
recorded on the walk). `every_outcome` runs walks until every combination of choices has been
taken, and returns the set of outcomes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...model.types import Protocol


@dataclass(frozen=True)
class Packet:
    """The first packet of a connection: origin is "pod" (arrives from a pod's interface),
    "node" (sent by the node itself) or "external" (arrives on the node's fabric)."""

    family: int
    saddr: str
    daddr: str
    protocol: Protocol
    dport: int
    origin: str
    iif: str = ""
    local_addresses: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Outcome:
    """What becomes of a packet: its verdict (accept, drop, reject), the DNAT target (which
    endpoint answers) and whether the endpoint sees the node's address (masquerade)."""

    verdict: str  # accept, drop, reject
    dnat: tuple[str, int] | None = None
    masquerade: bool = False


class Walk:
    """One walk of a packet, with fixed choices for the random numbers it meets."""

    def __init__(self, packet: Packet, choices: list[int]) -> None:
        self.packet, self.choices = packet, choices
        self.widths: list[int] = []
        self.daddr, self.dport = packet.daddr, packet.dport
        self.mark = 0
        self.dnat: tuple[str, int] | None = None
        self.masquerade = False
        self.sent_on = False  # a hook at input sent the packet on (IPVS): postrouting follows

    def choose(self, width: int) -> int:
        """The next random number in [0, width): the fixed choice, 0 past the fixed ones."""
        i = len(self.widths)
        self.widths.append(width)
        return self.choices[i] if i < len(self.choices) else 0

    def hook(self, hook: str) -> str:
        """Run the packet through one hook (prerouting, input, forward, output, postrouting):
        "accept", "drop" or "reject"."""
        raise NotImplementedError

    def is_local(self, address: str) -> bool:
        """Whether `address` is one of the node's (a packet to it is delivered here)."""
        return address in self.packet.local_addresses

    def run(self) -> Outcome:
        """The outcome of the walk. A packet delivered to the node (input) ends there unless a
        hook sent it on (`sent_on`: IPVS forwards what it takes at input to a real server,
        through postrouting)."""
        if self.packet.origin == "node":
            hooks = ["output", "postrouting"]
        else:
            hooks = ["prerouting", "routing", "postrouting"]
        for hook in hooks:
            if hook == "routing":
                if self.is_local(self.daddr):
                    verdict = self.hook("input")
                    if verdict != "accept":
                        return Outcome(verdict)
                    if not self.sent_on:
                        break  # delivered here: no postrouting
                    continue
                hook = "forward"
            verdict = self.hook(hook)
            if verdict != "accept":
                return Outcome(verdict)
        return Outcome("accept", self.dnat, self.masquerade)


def every_outcome(walk: Callable[[list[int]], Walk]) -> set[Outcome]:
    """Every outcome over all random choices: `walk(choices)` makes one walk."""
    outcomes: set[Outcome] = set()
    pending: list[list[int]] = [[]]
    while pending:
        prefix = pending.pop()
        one = walk(prefix)
        outcomes.add(one.run())
        for i in range(len(prefix), len(one.widths)):
            base = [*prefix, *([0] * (i - len(prefix)))]
            pending += [[*base, k] for k in range(1, one.widths[i])]
    return outcomes
