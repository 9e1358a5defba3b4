"""Come back within seconds of an apiserver outage, spread out (pure: the probe, the clock, the
sleep and the random source are passed in).

A reflector whose apiserver is unreachable backs off as client-go's does (`backoff`: up to 30 s,
jittered up to 60 s), so after an outage a change made during it reached the kernel 21-30 s
after the apiserver was back. `Recovery.wait(d)` waits as `sleep(d)` would, but probes the
apiserver meanwhile (`/readyz`, which every client may read) every `interval` seconds
(jittered by as much again) and, once a probe answers, returns after a random delay of at most
`spread` seconds instead of the rest of `d`: the reflectors of an agent resume within seconds,
and the agents of a cluster do not all return in the same instant.

The reflector then starts its backoff over: the apiserver answered, so what fails next (a 410
Gone from a restarted apiserver's watch cache, most often) waits 0.8-1.6 s, not the 30-60 s the
outage had grown the backoff to.

One `Recovery` serves all reflectors of an agent: a probe answered less than `interval` ago is
reused (single flight), so an agent sends at most one probe per interval during an outage.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

#: seconds between two probes while the apiserver is away (each jittered up by as much again)
INTERVAL = 1.0
#: the longest random delay before resuming, once a probe answers
SPREAD = 2.0


class Recovery:
    def __init__(
        self,
        probe: Callable[[], Awaitable[bool]],
        interval: float = INTERVAL,
        spread: float = SPREAD,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.probe, self.interval, self.spread = probe, interval, spread
        self.sleep, self.clock, self.rand = sleep, clock, rand
        self._answered_at: float | None = None  # when a probe last answered
        self._probed_at: float | None = None  # when the last probe began
        self._inflight: asyncio.Future[bool] | None = None
        self.probes = 0  # probes sent (for tests and metrics)
        self.early = 0  # waits cut short because the apiserver answered

    async def _probe_once(self) -> bool:
        """The apiserver answers; one probe in flight at a time, a recent answer reused."""
        now = self.clock()
        if self._answered_at is not None and now - self._answered_at < self.interval:
            return True
        if self._inflight is not None:
            return await asyncio.shield(self._inflight)
        if self._probed_at is not None and now - self._probed_at < self.interval:
            return False  # another reflector probed a moment ago, with no answer
        self._probed_at = now
        self.probes += 1
        self._inflight = asyncio.get_running_loop().create_future()
        try:
            try:
                ok = bool(await self.probe())
            except Exception:  # any failure to answer is "not back yet"
                ok = False
            if ok:
                self._answered_at = self.clock()
            self._inflight.set_result(ok)
            return ok
        finally:
            self._inflight = None

    async def wait(self, seconds: float) -> bool:
        """At most `seconds`; less when the apiserver answers a probe meanwhile (then True:
        it is back, the caller's backoff may start over)."""
        deadline = self.clock() + seconds
        while True:
            left = deadline - self.clock()
            if left <= 0:
                return False
            await self.sleep(min(left, self.interval * (1.0 + self.rand())))
            if deadline - self.clock() <= 0:
                return False
            if await self._probe_once():
                self.early += 1
                left = deadline - self.clock()
                await self.sleep(max(0.0, min(left, self.spread * self.rand())))
                return True
