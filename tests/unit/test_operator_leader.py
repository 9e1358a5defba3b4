"""Lease leader election against an in-memory Lease store with optimistic concurrency."""

from __future__ import annotations

import asyncio
import copy
import ssl
from collections.abc import Mapping
from typing import Any

import pytest

from kpx_operator.apiserver import ApiError, ApiServer, Credentials, NotLeader
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
    return LeaderElector(
        store,
        "kpx-system",
        "kpx-operator",
        identity,
        clock=clock,
        retry_period=0.01,
        renew_deadline=10,
        lease_duration=15,
    )


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


# ---- fencing: no write past the leadership's deadline ---------------------------------------


class SlowLeases(Leases):
    """Each request takes `delay` seconds of the fake clock (a slow apiserver)."""

    def __init__(self, clock: Clock, delay: float) -> None:
        super().__init__()
        self.clock, self.delay = clock, delay

    async def replace(self, obj: Mapping[str, Any]) -> Any:
        self.clock.now += self.delay
        return await super().replace(obj)


def test_the_write_deadline_counts_from_the_start_of_the_last_renewal() -> None:
    """A candidate saw the renewal after it started, so it may take over lease_duration after
    that start: the leader's deadline (renew_deadline) counts from the start too."""

    async def scenario() -> None:
        clock = Clock()
        store = SlowLeases(clock, delay=3)
        a = elector(store, "a", clock)
        await a.acquire()  # create: no delay
        assert a.lease_left() == 10
        clock.now += 5
        assert await a.try_acquire_or_renew()  # replace: 3 s
        assert a.lease_left() == 7
        clock.now += 7
        assert a.lease_left() == 0
        b = elector(store, "b", clock)
        assert not await b.try_acquire_or_renew()  # a still writes nothing: b must wait

    asyncio.run(scenario())


def test_a_hung_renewal_is_cut_off_at_the_deadline() -> None:
    """A renewal that never answers must not stretch the leadership (requests time out after
    30 s, the lease is 15 s): hold returns at the deadline, not after the request."""

    class Hung(Leases):
        hung = False

        async def get(self, kind: str, name: str, namespace: str | None = None) -> Any:
            if self.hung:
                await asyncio.Event().wait()
            return await super().get(kind, name, namespace)

    async def scenario() -> None:
        store = Hung()
        a = LeaderElector(
            store,
            "kpx-system",
            "kpx-operator",
            "a",
            retry_period=0.05,
            renew_deadline=0.5,
            lease_duration=1,
        )
        await a.acquire()
        store.hung = True
        await asyncio.wait_for(a.hold(), timeout=5)
        assert not a.is_leader and a.lease_left() == 0

    asyncio.run(scenario())


class Recording:
    """kpx_kube's client as the apply edge calls it: records what would have been sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def apply(self, path: str, obj: Any, **_: Any) -> tuple[int, dict[str, Any]]:
        self.sent.append(f"apply {path}")
        return 200, dict(obj)

    async def replace(self, path: str, obj: Any) -> dict[str, Any]:
        self.sent.append(f"replace {path}")
        return dict(obj)


def test_a_frozen_leader_writes_nothing_when_it_wakes_up() -> None:
    """SIGSTOPped past its deadline: every write but the Lease's is refused before it is sent."""

    async def scenario() -> None:
        store, clock = Leases(), Clock()
        a = elector(store, "a", clock)
        await a.acquire()
        api = ApiServer(Credentials("https://127.0.0.1:1", ssl.create_default_context()))
        recording = Recording()
        api.client = recording  # type: ignore[assignment]
        api.fence = a.lease_left
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kpx-agent-default", "namespace": "kpx-system"},
        }
        await api.apply(cm)
        assert recording.sent == [
            "apply /api/v1/namespaces/kpx-system/configmaps/kpx-agent-default"
        ]
        clock.now += 60  # frozen, then woken up
        with pytest.raises(NotLeader):
            await api.apply(cm)
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "kpx-operator", "namespace": "kpx-system"},
        }
        await api.replace(lease)  # the Lease itself is how it finds out: never fenced
        assert len(recording.sent) == 2 and recording.sent[1].startswith("replace ")

    asyncio.run(scenario())
