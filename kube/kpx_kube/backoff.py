"""The reflector's wait before it lists or watches again, as client-go's reflector waits (pure:
the clock and the random source are passed in).

client-go (tools/cache/reflector.go) runs ListAndWatch under
`wait.NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0)`: the first wait is 800 ms,
each next one twice the last, at most 30 s, and every wait is jittered up by as much again
(a wait of d lasts between d and 2d; so agents that lost their watches together do not come
back together). The sequence starts over once the last wait began more than 2 minutes ago (a
watch that lasted). `Backoff.reset` starts it over at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

INITIAL = 0.8
CAP = 30.0
RESET_AFTER = 120.0
FACTOR = 2.0
JITTER = 1.0


class Backoff:
    def __init__(
        self,
        initial: float = INITIAL,
        cap: float = CAP,
        reset_after: float = RESET_AFTER,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.initial, self.cap, self.reset_after = initial, cap, reset_after
        self.clock, self.rand = clock, rand
        self._next = initial
        self._last: float | None = None  # when the last wait began

    def reset(self) -> None:
        self._next = self.initial
        self._last = None

    def next(self) -> float:
        """The next wait (seconds), jittered; the one after it doubles (up to the cap)."""
        now = self.clock()
        if self._last is not None and now - self._last > self.reset_after:
            self._next = self.initial
        self._last = now
        base = self._next
        self._next = min(base * FACTOR, self.cap)
        return base * (1.0 + JITTER * self.rand())
