"""Make-before-break on a node: what other proxies left here goes only after our rules are in.

An agent starting on a node may find the rules of another proxy there: an agent of another kpx
mode (a mode switch), or upstream kube-proxy (a takeover, kube_proxy_leftovers.py). Removing
them before this agent has programmed its own rules leaves the node without a dataplane for as
long as the first lists and the first sync take (seconds at scale): new connections fail. So
`LeftoverRemoval.run` waits for the agent's first verified sync (a full sync that programmed
without error and whose rules the backend then finds in the kernel), and only then removes
each kind of leftover. Meanwhile both rule sets are in the kernel; they send each Service to
the same endpoints, and conntrack keeps every established connection on the NAT it got.

A removal that fails is logged, counted (kpx_leftover_removal_failures_total{leftovers}), and
retried with a growing delay (1 s doubling to `max_delay`); it never stops the agent, which
keeps serving. A leftover may also have a precondition (`Leftover.ready`, e.g. "upstream
kube-proxy no longer runs on this node"): until it holds, the removal is not attempted and
is checked again every `poll` seconds. kpx_leftovers_pending{leftovers} is 1 until a kind is
removed.

During a switch of mode, the old mode's rules gate the agent's readiness (`blocking`, with the
mode the agent's configuration says the switch comes from): its Pod turns Ready only once they
are gone, so the switch's next batch waits for the previous one's removal, and a removal that
keeps failing stops the rollout (saying why). Other kinds do not: a long-gone mode's rules an
agent may not even be able to read in its Pod (legacy iptables without NET_RAW), upstream
kube-proxy's, which wait for kube-proxy to leave the node.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from kpx_api.constants import LEFTOVERS_DRAINING, LEFTOVERS_REMOVED, OTHER_MODE_RULES
from kpx_api.nodestate import LeftoverKind, LeftoverState, PendingLeftover

from ..backends.base import Draining, Handover, Mode

log = logging.getLogger(__name__)


#: (event type "Normal"/"Warning", reason, message): an Event about the agent's Pod.
Report = Callable[[str, str, str], Awaitable[None]]


@dataclass(frozen=True)
class Leftover:
    """One kind of leftover: `remove` (blocking, run in a thread) removes all of it, and does
    nothing when there is none; `ready` (optional) says whether it may be removed now."""

    name: str
    description: str
    remove: Callable[[], None]
    ready: Callable[[], Awaitable[bool]] | None = None
    #: Event reasons: on removal (None: only logged) and when the precondition does not hold.
    removed_reason: str | None = None
    waiting_reason: str | None = None
    waiting_message: str = ""
    #: After its removal, keep checking `ready` (every `watch_poll` s): once it has failed
    #: (the other proxy came back: a kubeadm upgrade re-creates kube-proxy's DaemonSet) and
    #: then holds again (it left), remove this kind again.
    rearm: bool = False
    returned_reason: str | None = None
    returned_message: str = ""
    #: Whose rules (the ProxyNodeState's leftoversPending[].kind).
    kind: LeftoverKind = LeftoverKind.KPX_MODE


class LeftoverRemoval:
    def __init__(
        self,
        leftovers: Iterable[Leftover],
        registry: CollectorRegistry,
        report: Report | None = None,
        *,
        failed_reason: str = "LeftoversNotRemoved",
        first_delay: float = 1.0,
        max_delay: float = 60.0,
        poll: float = 5.0,
        watch_poll: float = 60.0,
        drain_poll: float = 15.0,
    ) -> None:
        self.pending: dict[str, Leftover] = {leftover.name: leftover for leftover in leftovers}
        #: removed kinds that may come back (`Leftover.rearm`) -> whether they are back
        self.watching: dict[str, tuple[Leftover, bool]] = {}
        self.watch_poll = watch_poll
        self.drain_poll = drain_poll
        self._draining: dict[str, str] = {}  # kinds whose removal waits for connections
        self.report = report
        self._errors: dict[str, str] = {}  # the last error of each pending kind
        self.failed_reason = failed_reason
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.poll = poll
        self._waiting_reported: set[str] = set()
        self._waiting: set[str] = set()  # pending kinds whose precondition does not hold now
        self._failure_reported: set[str] = set()
        self.failures = Counter(
            "kpx_leftover_removal_failures_total",
            "Attempts to remove another proxy's rules from this node that failed (retried)",
            ["leftovers"],
            registry=registry,
        )
        self.pending_gauge = Gauge(
            "kpx_leftovers_pending",
            "1 while this kind of leftover (another kpx mode, kube-proxy) waits to be removed",
            ["leftovers"],
            registry=registry,
        )
        for name in self.pending:
            self.pending_gauge.labels(name).set(1)

    def reset(self, leftovers: Iterable[Leftover]) -> None:
        """Remove these instead (an agent that rolled back to another mode); `run` again."""
        for name in self.pending:
            self.pending_gauge.remove(name)
        self.pending = {leftover.name: leftover for leftover in leftovers}
        self.watching.clear()
        self._draining.clear()
        self._errors.clear()
        self._waiting_reported.clear()
        self._waiting.clear()
        self._failure_reported.clear()
        for name in self.pending:
            self.pending_gauge.labels(name).set(1)

    def pending_reports(self) -> list[PendingLeftover]:
        """Each pending leftover with where its removal is and why it is still there (its last
        removal error, or what it waits for). A removed kind that came back (`Leftover.rearm`:
        kube-proxy runs on the node again) is pending again, waiting."""
        out = []
        for name, leftover in sorted(self.pending.items()):
            if name in self._errors:
                state = LeftoverState.FAILING
                why = f"could not remove {leftover.description} (retrying): {self._errors[name]}"
            elif name in self._draining:
                state = LeftoverState.DRAINING
                why = self._draining[name] or "waiting for its connections to end"
            elif name in self._waiting:
                state = LeftoverState.WAITING
                why = leftover.waiting_message or f"{leftover.description} not removed yet"
            else:
                state, why = LeftoverState.PENDING, f"{leftover.description} not removed yet"
            out.append(PendingLeftover(name=name, kind=leftover.kind, state=state, message=why))
        for name, (leftover, back) in sorted(self.watching.items()):
            if back and name not in self.pending:
                out.append(
                    PendingLeftover(
                        name=name,
                        kind=leftover.kind,
                        state=LeftoverState.WAITING,
                        message=leftover.returned_message,
                    )
                )
        return out

    def blocking(self, kinds: Collection[str]) -> str:
        """Why the agent must not be Ready yet: which of `kinds` is still pending, with the
        error of its last attempt; "" when none is."""
        gating = [
            (n, lo) for n, lo in self.pending.items() if n in kinds and n not in self._draining
        ]
        for name, leftover in gating:
            if name in self._errors:
                return f"could not remove {leftover.description} (retrying): {self._errors[name]}"
        if gating:
            return ", ".join(lo.description for _, lo in gating) + " not removed yet"
        return ""

    async def run(self, verified: asyncio.Event) -> None:
        """After `verified` is set (the agent's first verified sync), remove every leftover,
        retrying failures, until none is pending."""
        await verified.wait()
        delay = self.first_delay
        while self.pending or self.watching:
            if not self.pending:
                log.info("no leftovers of other proxies remain to be removed")
                while self.watching and not self.pending:
                    await asyncio.sleep(self.watch_poll)
                    await self.check_returned()
                delay = self.first_delay
                continue
            failed = await self.attempt()
            if not self.pending:
                continue
            if failed:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_delay)
            elif any(name in self._draining for name in self.pending):
                await asyncio.sleep(self.drain_poll)
            else:  # only preconditions outstanding
                await asyncio.sleep(self.poll)
        log.info("no leftovers of other proxies remain to be removed")

    async def check_returned(self) -> None:
        """For each removed kind that may come back: has it (its precondition fails), and has
        it left again since (it holds)? Then it is pending again."""
        for name, (leftover, back) in list(self.watching.items()):
            if leftover.ready is None:
                continue
            try:
                ready = await leftover.ready()
            except Exception as exc:  # an unreachable apiserver: ask again later
                log.debug("%s: cannot tell whether it came back: %s", name, exc)
                continue
            if not ready and not back:
                self.watching[name] = (leftover, True)
                log.info("%s: %s", leftover.description, leftover.returned_message)
                if leftover.returned_reason:
                    await self._report(
                        "Normal", leftover.returned_reason, leftover.returned_message
                    )
            elif ready and back:
                del self.watching[name]
                self.pending[name] = leftover
                self._waiting_reported.discard(name)
                self._failure_reported.discard(name)
                self.pending_gauge.labels(name).set(1)

    async def attempt(self) -> bool:
        """One pass over the pending leftovers; whether any removal failed."""
        failed = False
        for name, leftover in list(self.pending.items()):
            if leftover.ready is not None:
                try:
                    ready = await leftover.ready()
                except Exception as exc:  # an unreachable apiserver: ask again later
                    log.warning("%s: cannot tell whether it may be removed: %s", name, exc)
                    failed = True
                    continue
                if not ready:
                    self._waiting.add(name)
                    if name not in self._waiting_reported:
                        self._waiting_reported.add(name)
                        log.info("%s: %s", leftover.description, leftover.waiting_message)
                        if leftover.waiting_reason:
                            await self._report(
                                "Normal", leftover.waiting_reason, leftover.waiting_message
                            )
                    continue
                self._waiting.discard(name)
            try:
                await asyncio.to_thread(leftover.remove)
            except Draining as exc:
                if name not in self._draining:
                    log.info("%s: draining: %s", leftover.description, exc)
                    await self._report(
                        "Normal", LEFTOVERS_DRAINING, f"{leftover.description}: {exc}"
                    )
                self._draining[name] = str(exc)
                self._errors.pop(name, None)
                continue
            except Exception as exc:
                failed = True
                self._errors[name] = str(exc)
                self.failures.labels(name).inc()
                log.warning("could not remove %s (will retry): %s", leftover.description, exc)
                if name not in self._failure_reported:
                    self._failure_reported.add(name)
                    await self._report(
                        "Warning",
                        self.failed_reason,
                        f"could not remove {leftover.description} (retrying): {exc}",
                    )
                continue
            del self.pending[name]
            self._waiting.discard(name)
            self._errors.pop(name, None)
            self._draining.pop(name, None)
            self.pending_gauge.labels(name).set(0)
            if leftover.rearm:
                self.watching[name] = (leftover, False)
            log.info("removed %s (if there were any)", leftover.description)
            if leftover.removed_reason:
                await self._report(
                    "Normal", leftover.removed_reason, f"removed {leftover.description}"
                )
        return failed

    async def _report(self, type_: str, reason: str, message: str) -> None:
        if self.report is not None:
            await self.report(type_, reason, message)


def other_mode_leftovers(
    mode: str,
    modes: Iterable[str],
    load: Callable[[str], Mode],
    handover: Handover,
) -> list[Leftover]:
    """The rules of every kpx mode but `mode` (a mode switch leaves the old mode's behind):
    each removed by that mode's `remove_leftovers(handover)` (ipvs: only what a kpx agent
    made, not upstream kube-proxy's virtual servers; the others: their full cleanup), its
    code loaded only then. Each removal is reported as an Event LeftoversRemoved ("removed
    the rules of kpx mode M")."""

    def remover(other: str) -> Callable[[], None]:
        def remove() -> None:
            load(other).remove_leftovers(handover)

        return remove

    return [
        Leftover(
            other,
            f"{OTHER_MODE_RULES}{other}",
            remover(other),
            removed_reason=LEFTOVERS_REMOVED,
        )
        for other in modes
        if other != mode
    ]
