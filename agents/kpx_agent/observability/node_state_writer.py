"""The I/O edge of this node's ProxyNodeState (node_state.py decides what and when).

`NodeStateWriter.run` looks at the agent's facts whenever the agent pokes it (after a sync,
a rollback, a configuration reload) and at least once per interval (leftover removals,
which have no hook); the WriteGate says whether to write, and when. The first write creates
the object (owned by the Node); later ones are merge patches of its status subresource. A
refused write is logged and tried again after the interval; an object deleted meanwhile is
created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kpx_api.constants import GROUP, VERSION
from kpx_api.nodestate import NODE_STATE_PLURAL
from kpx_kube import AlreadyExists, ApiError, Client, NotFound

from .node_state import DEFAULT_WRITE_INTERVAL, NodeFacts, WriteGate, node_state_object, status_of

log = logging.getLogger(__name__)
COLLECTION = f"/apis/{GROUP}/{VERSION}/{NODE_STATE_PLURAL}"


class NodeStateWriter:
    def __init__(
        self,
        client: Client,
        node: str,
        facts: Callable[[], NodeFacts],
        node_uid: Callable[[], str | None] = lambda: None,
        interval: float = DEFAULT_WRITE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.node = node
        self.facts = facts
        self.node_uid = node_uid
        self.gate = WriteGate(interval)
        self.clock = clock
        self.writes = 0  # status writes that succeeded (and creates)
        self.failures = 0
        self._created = False
        self._wake = asyncio.Event()

    @property
    def path(self) -> str:
        return f"{COLLECTION}/{self.node}"

    def poke(self) -> None:
        """Something the status shows may have changed."""
        self._wake.set()

    async def _poked(self, timeout: float) -> None:
        """Until poked, or `timeout` s. Not asyncio.wait_for: on Python 3.11 it swallows a
        cancellation that comes as the poke does, and the agent would never stop this task."""
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            waiter.cancel()

    async def run(self) -> None:
        while True:
            await self._poked(self.gate.interval)
            self._wake.clear()
            wait = self.gate.wait(status_of(self.facts()), self.clock())
            if wait is None:
                continue
            if wait > 0:
                # Coalesce: what holds after the wait is written. A hair past the end of the
                # interval: a timer may fire a clock tick early, and the gate is strict.
                await asyncio.sleep(wait + 0.005)
            await self.write_once()

    async def write_once(self) -> bool:
        """Write the current status if the gate allows it now; whether it was written."""
        status = status_of(self.facts())
        now = self.clock()
        if self.gate.wait(status, now) != 0.0:
            return False
        try:
            if not self._created:
                await self._create()
            try:
                await self.client.patch_status(self.path, status)
            except NotFound:  # deleted by someone: again
                self._created = False
                await self._create()
                await self.client.patch_status(self.path, status)
        except ApiError as exc:
            self.failures += 1
            # Counted as written: the next attempt comes after the interval, not at once.
            self.gate.wrote({}, now)
            self.gate.forget()
            log.warning("ProxyNodeState %s not written (retrying): %s", self.node, exc)
            return False
        self.gate.wrote(status, now)
        self.writes += 1
        return True

    async def _create(self) -> None:
        with contextlib.suppress(AlreadyExists):
            await self.client.create(COLLECTION, node_state_object(self.node, self.node_uid()))
        self._created = True
