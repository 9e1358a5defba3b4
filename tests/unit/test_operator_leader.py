"""Lease leader election against an in-memory Lease store with optimistic concurrency."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

import pytest

from kpx_operator.apiserver import ApiError
from kpx_operator.leader import LeaderElector, LeaseRecord, can_take


class Leases:
    """GET/POST/PUT of Leases with resourceVersion checks, like the apiserver."""

    def __init__(self) -> None:
        self.objs: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ApiError(0, "Unreachable", "connection refused")

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
        self._check()
        return copy.deepcopy(self.objs.get(name))

    async def create(self, obj: Mapping[str, Any]) -> Any:
        self._check()
        name = obj["metadata"]["name"]
        if name in self.objs:
            raise ApiError(409, "AlreadyExists", name)
        return self._store(obj)

    async def replace(self, obj: Mapping[str, Any]) -> Any:
        self._check()
        name = obj["metadata"]["name"]
        if obj["metadata"].get("resourceVersion") != self.objs[name]["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        return self._store(obj)

    def _store(self, obj: Mapping[str, Any]) -> Any:
        self.version += 1
        stored = copy.deepcopy(dict(obj))
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.objs[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(store: Leases, identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(store, "kpx-system", "kpx-operator", identity, clock=clock,
                         retry_period=0.01, renew_deadline=10, lease_duration=15)  # fmt: skip


def record(holder: str, duration: float = 15) -> LeaseRecord:
    return LeaseRecord(holder, duration, "t", "t", 0, "1")


@pytest.mark.parametrize(
    ("holder", "observed_at", "now", "ok"),
    [
        ("", 0, 0, True),  # free (released)
        ("me", 0, 0, True),  # ours: renew
        ("other", 100, 110, False),  # held and recently renewed
        ("other", 100, 115, True),  # not renewed for its duration (by our clock)
    ],
)
def test_can_take(holder: str, observed_at: float, now: float, ok: bool) -> None:
    assert can_take(record(holder), "me", observed_at, now) is ok


def test_one_leader_then_takeover_after_expiry() -> None:
    async def scenario() -> None:
        store, clock = Leases(), Clock()
        a, b = elector(store, "a", clock), elector(store, "b", clock)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
        clock.now += 10
        assert await a.try_acquire_or_renew()  # renewed: b's observation restarts
        assert not await b.try_acquire_or_renew()
        clock.now += 14
        assert not await b.try_acquire_or_renew()  # 14 s since b saw the renewal
        clock.now += 1
        assert await b.try_acquire_or_renew()  # a stopped renewing 15 s ago
        spec = store.objs["kpx-operator"]["spec"]
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
        assert not await a.try_acquire_or_renew()

    asyncio.run(scenario())


def test_release_lets_the_other_take_over_at_once() -> None:
    async def scenario() -> None:
        store, clock = Leases(), Clock()
        a, b = elector(store, "a", clock), elector(store, "b", clock)
        await a.acquire()
        assert not await b.try_acquire_or_renew()
        await a.release()
        assert store.objs["kpx-operator"]["spec"]["holderIdentity"] == ""
        assert await b.try_acquire_or_renew()

    asyncio.run(scenario())


def test_leader_steps_down_when_it_cannot_renew() -> None:
    async def scenario() -> None:
        store, clock = Leases(), Clock()
        a = elector(store, "a", clock)
        await a.acquire()
        store.down = True

        async def tick() -> None:
            while True:
                await asyncio.sleep(0.005)
                clock.now += 1

        ticker = asyncio.create_task(tick())
        await asyncio.wait_for(a.hold(), timeout=5)
        ticker.cancel()
        assert not a.is_leader

    asyncio.run(scenario())
