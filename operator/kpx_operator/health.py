"""The operator's health: /healthz (liveness) and /readyz (readiness) from what it knows of its
watch and its leadership; pure state here, served by `health_app`.

- The watch: kopf's operator task runs, and once this replica leads, kopf said it is ready
  (its watches listed what they index). A probe lists ProxyConfigurations every
  `probe_interval` seconds (what the watch needs: the apiserver answers, the CRD is served,
  this identity may list it); `failures_allowed` failures in a row make the watch unhealthy.
- The leadership: a leader whose Lease was not renewed within its deadline (`lease_left` 0)
  is unhealthy (it stops acting at once, and exits). A standby that waits for the Lease is
  healthy and ready: it is doing its job, and a Deployment of two replicas must read Ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

STARTING, STANDBY, LEADING, STOPPED = "starting", "standby", "leading", "stopped"


@dataclass
class OperatorHealth:
    #: Whether leader election is on (off: this replica acts at once, "leading").
    leader_elect: bool = True
    failures_allowed: int = 3
    clock: Callable[[], float] = time.monotonic
    role: str = STARTING
    #: kopf's watches are up (its ready flag), and kopf's task has not ended.
    watching: bool = False
    operator_ended: str = ""
    #: Seconds this replica may still write as the leader (the elector's `lease_left`).
    lease_left: Callable[[], float] = field(default=lambda: float("inf"))
    probe_failures: int = 0
    probe_error: str = ""
    last_probe_ok: float | None = None

    def probed(self, error: str | None) -> None:
        """The outcome of one list probe (None: it answered)."""
        if error is None:
            self.probe_failures, self.probe_error = 0, ""
            self.last_probe_ok = self.clock()
        else:
            self.probe_failures += 1
            self.probe_error = error

    def problems(self) -> list[str]:
        """What makes this replica unhealthy ([]: nothing)."""
        found = []
        if self.operator_ended:
            found.append(f"watch: kopf stopped: {self.operator_ended}")
        if self.probe_failures >= self.failures_allowed:
            found.append(
                f"watch: listing ProxyConfigurations failed {self.probe_failures} times in a "
                f"row: {self.probe_error}"
            )
        if self.role == LEADING and self.leader_elect and self.lease_left() <= 0:
            found.append("leadership: the Lease was not renewed within its deadline")
        if self.role == STOPPED:
            found.append("leadership: lost; the operator stops")
        return found

    def _body(self, problems: list[str]) -> dict[str, object]:
        return {
            "ok": not problems,
            "role": self.role,
            "leader": self.role == LEADING,
            "watching": self.watching,
            "problems": problems,
        }

    def healthz(self) -> tuple[int, dict[str, object]]:
        problems = self.problems()
        return (503 if problems else 200), self._body(problems)

    def readyz(self) -> tuple[int, dict[str, object]]:
        """Ready: healthy, and either leading with kopf's watches up, or a standby whose
        probe answered."""
        problems = self.problems()
        if not problems:
            if self.role == STARTING:
                problems = ["starting: the ProxyConfiguration API is not served yet"]
            elif self.role == LEADING and not self.watching:
                problems = ["leading: kopf's watches are not up yet"]
            elif self.last_probe_ok is None:
                problems = ["the apiserver has not answered a list yet"]
        return (503 if problems else 200), self._body(problems)


async def probe_loop(
    health: OperatorHealth, probe: Callable[[], Awaitable[object]], interval: float
) -> None:
    """Run `probe` every `interval` seconds and record the outcome."""
    while True:
        try:
            await asyncio.wait_for(probe(), timeout=max(interval, 5.0))
        except Exception as exc:  # any failure is the watch's failure; said in /healthz
            health.probed(f"{type(exc).__name__}: {exc}"[:300])
            log.warning("health probe: listing ProxyConfigurations failed: %s", exc)
        else:
            health.probed(None)
        await asyncio.sleep(interval)
