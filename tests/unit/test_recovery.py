"""After an apiserver outage, a reflector's wait ends within seconds of its return, spread out
(kpx_kube.recovery); a refusal with Retry-After and a wait while the apiserver stays away keep
their length. Fake clock and sleep: no real time passes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest
from test_reflector_retries import RES, Clock, FakeApi, Names, Obj, Stop

from kpx_kube import errors
from kpx_kube.backoff import Backoff
from kpx_kube.recovery import Recovery
from kpx_kube.reflector import Reflector


def recovery(clock: Clock, back_at: float, slept: list[float], rand: float = 0.5) -> Recovery:
    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    async def probe() -> bool:
        return clock.now >= back_at

    return Recovery(probe, sleep=sleep, clock=clock, rand=lambda: rand)


def test_a_long_wait_ends_within_seconds_of_the_apiserver_coming_back() -> None:
    clock = Clock()
    slept: list[float] = []
    rec = recovery(clock, back_at=clock.now + 5.0, slept=slept)
    assert asyncio.run(rec.wait(50.0)) is True
    # probes every 1.5 s (1 s jittered by half) until one answers at 6 s, then a spread of 1 s
    # (half of 2 s): 7 s instead of 50
    assert clock.now - 1000.0 == pytest.approx(7.0)
    assert rec.probes == 4 and rec.early == 1


def test_the_wait_keeps_its_length_while_the_apiserver_stays_away() -> None:
    clock = Clock()
    slept: list[float] = []
    rec = recovery(clock, back_at=float("inf"), slept=slept)
    assert asyncio.run(rec.wait(10.0)) is False
    assert clock.now - 1000.0 == pytest.approx(10.0)
    assert rec.early == 0
    assert rec.probes == 6  # one per 1.5 s, none after the deadline


def test_the_spread_is_random_and_never_past_the_wait() -> None:
    ends = []
    for rand in (0.0, 0.5, 0.99):
        clock = Clock()
        rec = recovery(clock, back_at=clock.now, slept=[], rand=rand)
        asyncio.run(rec.wait(30.0))
        ends.append(clock.now - 1000.0)
    assert ends == sorted(ends) and len(set(ends)) == 3  # agents come back at different times
    assert max(ends) < 4.0  # a probe interval (1-2 s) and a spread (0-2 s)
    clock = Clock()
    rec = recovery(clock, back_at=clock.now, slept=[], rand=0.99)
    asyncio.run(rec.wait(2.5))
    assert clock.now - 1000.0 <= 2.5


def test_one_probe_serves_every_reflector_of_an_agent() -> None:
    clock = Clock()
    calls = 0

    async def probe() -> bool:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        return False

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    rec = Recovery(probe, sleep=sleep, clock=clock, rand=lambda: 0.0)

    async def four_at_once() -> list[bool]:
        return await asyncio.gather(*(rec._probe_once() for _ in range(4)))

    assert asyncio.run(four_at_once()) == [False] * 4
    assert calls == 1  # single flight, and a recent probe is not repeated
    assert not asyncio.run(rec._probe_once()) and calls == 1
    clock.now += 1.0
    asyncio.run(rec._probe_once())
    assert calls == 2


class Outage(FakeApi):
    """Refuses every watch while the clock is before `back_at`; once back, the next watch
    ends the run as it is opened (Stop), at the moment the reflector resumed."""

    def __init__(self, clock: Clock, back_at: float) -> None:
        super().__init__([])
        self.clock, self.back_at = clock, back_at

    def watch(self, resource: str, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        if self.clock.now < self.back_at:
            return FakeApi([errors.Unreachable("connection refused")]).watch(resource, path, params)
        return super().watch(resource, path, params)


def run_with_recovery(api: FakeApi, clock: Clock, back_at: float) -> Recovery:
    slept: list[float] = []
    rec = recovery(clock, back_at=back_at, slept=slept)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    reflector = Reflector(
        api,
        RES,
        Names(),
        backoff=Backoff(clock=clock, rand=lambda: 1.0),
        sleep=sleep,
        clock=clock,
        recovery=rec,
    )
    with pytest.raises(Stop):
        asyncio.run(reflector.run())
    return rec


def test_a_reflector_resumes_within_seconds_after_an_outage() -> None:
    """A 40 s outage: the watch resumes within a probe interval and a spread of the
    apiserver's return, where the backoff alone (1.6+3.2+...+51.2 s, jitter at its top) would
    resume 61 s after it."""
    clock = Clock()
    back_at = clock.now + 40.0
    rec = run_with_recovery(Outage(clock, back_at), clock, back_at)
    assert rec.early == 1
    assert 0 <= clock.now - back_at < 4.0


class GoneAfterOutage(Outage):
    """After the outage the first watch gets 410 Gone (a restarted apiserver's watch cache
    no longer has the resourceVersion); the relist's watch then ends the run."""

    def __init__(self, clock: Clock, back_at: float) -> None:
        super().__init__(clock, back_at)
        self.gone_sent = False

    def watch(self, resource: str, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        if self.clock.now >= self.back_at and not self.gone_sent:
            self.gone_sent = True
            expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}
            return FakeApi([[expired]]).watch(resource, path, params)
        return super().watch(resource, path, params)


def test_a_410_after_the_outage_relists_within_seconds_not_after_the_grown_backoff() -> None:
    clock = Clock()
    back_at = clock.now + 40.0
    api = GoneAfterOutage(clock, back_at)
    rec = run_with_recovery(api, clock, back_at)
    assert rec.early == 1 and api.gone_sent
    assert api.kinds()[-2:] == ["list", "watch"]  # relisted, then watched
    # the relist waited the backoff's first step (0.8 s, jitter at its top: 1.6 s), not 60 s
    assert clock.now - back_at < 4.0 + 1.6


def test_retry_after_is_honoured_to_the_end() -> None:
    """A 429 with Retry-After: the apiserver is up and asked for that long; no shortcut."""
    told = errors.ApiError(429, "TooManyRequests", "slow down", retry_after=20.0)
    clock = Clock()
    rec = run_with_recovery(FakeApi([told]), clock, back_at=0.0)
    assert rec.probes == 0 and rec.early == 0
    assert clock.now - 1000.0 >= 20.0
