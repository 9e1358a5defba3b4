"""The sync loop: when the agent syncs, and each sync off the event loop.

It wakes on every recorded change (`wake`), runs at most one sync per minSyncPeriod (bursts
coalesce), reads the kernel back every syncPeriod while syncs go on and judges the reading
between syncs (the drift check: a periodic resync that finds the kernel as programmed is a
successful update), retries a failed sync after 1 s,
doubling up to 30 s (every Service recomputed), goes on at once while a partial sync left
ports to the next ones (the budget of one sync, budget.py: what was recorded meanwhile joins
them), and lets the agent roll back between syncs
(nothing programs then). What an outcome means for health, Events and this node's
ProxyNodeState is the agent's (`SyncHost.after_sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import Protocol

from kpx_kube import collector
from kpx_kube.reflector import Reflector

from ..observability.proxy_health import ProxyHealth
from ..settings import AgentSettings
from ..store.cluster_state import ClusterState
from .proxier import KernelReading, Proxier, SyncOutcome

log = logging.getLogger(__name__)
#: A sync failure with the same error is reported as an Event at most this often (s).
SYNC_FAILURE_REPORT_INTERVAL = 60.0
#: The longest wait before a failed sync is retried (s); the first retry comes after 1 s.
MAX_RETRY_DELAY = 30.0


def sync_failure_due(
    told: tuple[str, float] | None,
    error: str,
    now: float,
    interval: float = SYNC_FAILURE_REPORT_INTERVAL,
) -> bool:
    """Whether a sync failure with `error` is reported now, the last report being `told`
    ((error, time), None after a success): a new error at once, the same one once per
    `interval`."""
    return told is None or told[0] != error or now - told[1] >= interval


_NFT_LOCATION = re.compile(r"/dev/stdin:\d+:\d+(-\d+)?: ")


def brief_error(error: str, limit: int = 600) -> str:
    """A backend's error for an Event: each distinct line once (nft repeats its complaint per
    statement, with a location and a line of carets under it), joined by " | ", at most
    `limit` characters."""
    lines: list[str] = []
    for raw in error.splitlines():
        line = _NFT_LOCATION.sub("", raw.strip())
        if line and set(line) - {"^", "~", " "} and line not in lines:
            lines.append(line)
    text = " | ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SyncHost(Protocol):
    """What the loop needs of the agent that runs it (agent.Agent)."""

    settings: AgentSettings  # syncPeriod, minSyncPeriod: read anew each round (reloads)
    proxier: Proxier
    state: ClusterState
    health: ProxyHealth

    def rollback_left(self) -> float | None: ...

    async def roll_back(self) -> bool: ...

    async def after_sync(self, outcome: SyncOutcome) -> None: ...


class SyncLoop:
    def __init__(self, host: SyncHost) -> None:
        self.host = host
        #: Set by whatever may need a sync (watch events, reloads, a failed verification).
        self.wake = asyncio.Event()
        self.synced_once = False  # until the first sync was attempted
        #: The periodic check's reading of the kernel while it is under way: it runs while
        #: syncs go on (seconds at scale in iptables mode), and is judged between syncs.
        self.reading: asyncio.Task[KernelReading] | None = None

    async def run(self, excluding: tuple[Reflector, ...]) -> None:
        """Sync until cancelled; `excluding` are the reflectors that leave opted-out
        namespaces out (reselected when the opted-out namespaces change)."""
        try:
            await self._run(excluding)
        finally:
            if self.reading is not None:
                self.reading.cancel()

    async def _run(self, excluding: tuple[Reflector, ...]) -> None:
        host = self.host
        last_start = 0.0
        next_resync = time.monotonic() + host.settings.sync_period
        retry_delay = 0.0
        while True:
            timeout = max(0.0, next_resync - time.monotonic())
            if retry_delay:
                timeout = min(timeout, retry_delay)
            left = host.rollback_left()
            if left is not None:
                timeout = min(timeout, left)
            continuing = host.proxier.has_deferred()
            if continuing:
                timeout = 0.0
            # (asyncio.timeout, not wait_for: Python 3.11's wait_for returns instead of raising
            # when it is cancelled as the wake-up arrives, and the loop then never stopped.)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
            self.wake.clear()
            if host.rollback_left() == 0.0 and await host.roll_back():
                retry_delay = 0.0
                next_resync = time.monotonic() + host.settings.sync_period
            now = time.monotonic()
            if now >= next_resync and self.reading is None:
                # The node-local state only changes through recorded changes, so there is
                # nothing to recompute; what can change behind our back is the kernel.
                # Reading it back (the drift check) takes seconds at scale: no change waits
                # for that, the reading is judged once it is in.
                self.reading = asyncio.create_task(asyncio.to_thread(host.proxier.read_kernel))
                self.reading.add_done_callback(lambda _: self.wake.set())
                next_resync = now + host.settings.sync_period
            if self.reading is not None and self.reading.done():
                reading, self.reading = self.reading.result(), None
                host.proxier.repair(await asyncio.to_thread(host.proxier.check_kernel, reading))
                if not host.state.has_changes() and not retry_delay:
                    # The periodic resync found the kernel as programmed: a successful
                    # update, as upstream's periodic sync is.
                    host.health.updated()
            # Coalesce bursts: at most one sync per minSyncPeriod (the rest of a change that
            # one sync's budget split goes on at once).
            wait = last_start + host.settings.min_sync_period - now
            if wait > 0 and not continuing:
                await asyncio.sleep(wait)
            before = host.proxier.excluded
            if host.proxier.update_excluded():
                after = host.proxier.excluded
                log.info("opted-out namespaces now: %s", sorted(after))
                for reflector in excluding:  # no relist: only these namespaces move
                    reflector.reselect(included=before - after, excluded=after - before)
            if not host.state.has_changes() and not retry_delay and not continuing:
                continue
            last_start = time.monotonic()
            outcome = await self._sync_once()
            if outcome.ok:
                retry_delay = 0.0
            else:
                retry_delay = min(max(retry_delay * 2, 1.0), MAX_RETRY_DELAY)
                host.state.touch_all()
            await host.after_sync(outcome)

    async def _sync_once(self) -> SyncOutcome:
        proxier = self.host.proxier
        first = not self.synced_once
        # The first sync allocates about a million objects that all live on (the node-local
        # state, the backend's record): collecting there is pure cost, and they are frozen
        # before the collector is back on (collector.paused).
        with collector.paused(freeze=True) if first else contextlib.nullcontext():
            pending = proxier.prepare()
            # The kernel edge blocks for up to seconds at scale: keep the event loop
            # (health, metrics, watches) responsive while it runs.
            outcome = await asyncio.to_thread(proxier.program, pending)
        self.synced_once = True
        return outcome
