"""Leader election on a coordination.k8s.io Lease, as client-go does it.

Several replicas run; one holds the Lease and runs the kopf handlers, the others wait. The
holder renews the Lease every `retry_period`; a candidate takes it over when it is free (no
holder: released on a clean exit) or when its record has not changed for `lease_duration`
seconds by the candidate's own clock (so clock skew between nodes does not matter). A leader
that cannot renew within `renew_deadline` stops (the process exits and restarts as a
candidate), which is shorter than the lease duration: it stops acting before anyone else
starts.

Fencing: the leader may write only until `renew_deadline` after the *start* of its last
successful renewal (`lease_left`). A candidate that saw that renewal saw it after it started, so
it takes over `lease_duration` (> `renew_deadline`) after it at the earliest. Every renewal
attempt is cut off at that deadline (a hung request cannot stretch it), `hold` returns at the
deadline, and the operator's apply edge refuses writes past it (`ApiServer.fence`). A leader
that was frozen (SIGSTOP, a paused VM) wakes up past its deadline and writes nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from .apiserver import ApiError

log = logging.getLogger("kpx_operator.leader")

MICRO_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class LeaseApi(Protocol):
    async def get(self, kind: str, name: str, namespace: str | None = None) -> Any: ...
    async def create(self, obj: Mapping[str, Any]) -> Any: ...
    async def replace(self, obj: Mapping[str, Any]) -> Any: ...


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    duration: float
    renew_time: str
    acquire_time: str
    transitions: int
    resource_version: str

    @classmethod
    def from_lease(cls, lease: Mapping[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration=float(spec.get("leaseDurationSeconds") or 0),
            renew_time=str(spec.get("renewTime") or ""),
            acquire_time=str(spec.get("acquireTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str((lease.get("metadata") or {}).get("resourceVersion") or ""),
        )


def can_take(record: LeaseRecord, identity: str, observed_at: float, now: float) -> bool:
    """Whether `identity` may write itself into the Lease: it is free, already ours, or its
    record has not changed for its duration since we first saw it (local monotonic clock)."""
    if not record.holder or record.holder == identity:
        return True
    return now >= observed_at + record.duration


def default_identity() -> str:
    """POD_NAME (or the hostname) plus a random suffix: a restarted process is a new
    candidate and never mistakes its predecessor's record for its own."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


class LeaderElector:
    def __init__(
        self,
        api: LeaseApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.clock = clock
        self.is_leader = False
        self._seen: tuple[str, str] | None = None  # (holder, renewTime) last observed
        self._seen_at = 0.0
        # Monotonic time until which this replica may write: the start of its last successful
        # acquire or renewal plus renew_deadline.
        self._valid_until = 0.0

    def lease_left(self) -> float:
        """Seconds this replica may still write as the leader (0: it must not write)."""
        if not self.is_leader:
            return 0.0
        return max(0.0, self._valid_until - self.clock())

    def _lease(self, record: LeaseRecord | None, now: str) -> dict[str, Any]:
        ours = record is not None and record.holder == self.identity
        transitions = record.transitions if record else 0
        if record is not None and not ours:  # as client-go: also after a release
            transitions += 1
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record is not None:
            meta["resourceVersion"] = record.resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.lease_duration),
                "acquireTime": record.acquire_time if ours and record else now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when we hold the Lease afterwards."""
        now = datetime.now(UTC).strftime(MICRO_TIME)
        started = self.clock()
        try:
            lease = await self.api.get("Lease", self.name, self.namespace)
            if lease is None:
                await self.api.create(self._lease(None, now))
                self._valid_until = started + self.renew_deadline
                return True
            record = LeaseRecord.from_lease(lease)
            if (record.holder, record.renew_time) != self._seen:
                self._seen, self._seen_at = (record.holder, record.renew_time), self.clock()
            if not can_take(record, self.identity, self._seen_at, self.clock()):
                return False
            await self.api.replace(self._lease(record, now))
            self._valid_until = started + self.renew_deadline
            return True
        except ApiError as exc:
            if exc.status != 409:  # 409: someone else wrote first
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
            return False

    async def acquire(self) -> None:
        """Wait until we lead."""
        log.info(
            "waiting to lead (lease %s/%s, identity %s)", self.namespace, self.name, self.identity
        )
        while not await self.try_acquire_or_renew():
            await asyncio.sleep(self.retry_period)
        self.is_leader = True
        log.info("leading as %s", self.identity)

    async def hold(self) -> None:
        """Renew every `retry_period` until the write deadline (`lease_left`) passes without a
        successful renewal; then return (lost). An attempt still running at the deadline is
        cancelled."""
        while True:
            left = self.lease_left()
            if left > 0:
                await asyncio.sleep(min(self.retry_period, left))
                left = self.lease_left()
            if left <= 0:
                self.is_leader = False
                log.error("lost the lease %s/%s", self.namespace, self.name)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.try_acquire_or_renew(), left)

    async def release(self) -> None:
        """Give the Lease up (on a clean exit) so another replica takes over at once."""
        if not self.is_leader:
            return
        self.is_leader = False
        try:
            lease = await self.api.get("Lease", self.name, self.namespace)
            if lease is None or LeaseRecord.from_lease(lease).holder != self.identity:
                return
            lease["spec"] = {
                **lease.get("spec", {}),
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
            }
            await self.api.replace(lease)
            log.info("released the lease %s/%s", self.namespace, self.name)
        except ApiError as exc:
            log.warning("could not release the lease: %s", exc)
