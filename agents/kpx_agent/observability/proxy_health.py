"""The agent's own health, as upstream kube-proxy's proxier health server decides it.

Pure timing and node logic (the clock is passed in); the HTTP handlers in `http_endpoints`
only read it. Upstream's rules (pkg/proxy/healthcheck/proxier_health.go, v1.36):

- healthy by default: while idle (nothing queued) the agent is healthy however long ago the
  last sync was;
- `queued_update` when a change that needs programming is recorded (only the oldest pending
  one counts), `updated` when the kernel was programmed successfully or the periodic resync
  found nothing to do; a failed sync leaves the change pending;
- unhealthy once a pending change is older than the timeout, which upstream sets to
  2 x syncPeriod (cmd/kube-proxy: `NewProxierHealthServer(..., 2*config.SyncPeriod)`);
- `/healthz` is also unhealthy while this node is not eligible for traffic (being deleted, or
  tainted `ToBeDeletedByClusterAutoscaler`), so load balancers drain it; `/livez` ignores that.

kpx adds a dead watch (a reflector whose view may be wrong after an unexpected error, until it
listed again, or whose task ended): `/healthz` and `/livez` answer 503 while one is dead, with
`deadWatches` in the body (the agent would program a frozen view).

kpx adds `/alivez` (upstream has none), the DaemonSet's liveness probe: 503 only for what a
restart fixes (a dead watch; an event loop that is stuck does not answer at all). Not for a
change the kernel keeps refusing (a poison object): a restart fixes nothing there, and every
agent restarting at once is a relist of everything by every node.

kpx adds `/readyz` (upstream has none), the DaemonSet's readiness probe: `/healthz`'s answer,
and 503 until this agent's first full sync was programmed and found in the kernel, and during
a switch of mode until the old mode's rules were removed from its node (the next batch waits
for the removal, which may fail and is retried), and for good once the agent
rolled its node back to the mode before a switch (rollback.py). So a Ready agent pod serves
its node alone, and a mode switch or an upgrade (a DaemonSet rolling update) does not move on
from a node whose new agent cannot program its kernel (it keeps serving on the rules it had,
which are removed only after a verified sync) or cannot remove the old rules. The body says
why in `notReady`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"

Obj = Mapping[str, Any]


def node_eligible(node: Obj | None) -> bool:
    """False while the Node is being deleted or carries the cluster autoscaler's deletion
    taint; True otherwise, and while the Node is not known (as upstream at start-up)."""
    if node is None:
        return True
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        return False
    taints = (node.get("spec") or {}).get("taints") or []
    return not any(t.get("key") == TO_BE_DELETED_TAINT for t in taints)


def health_timeout(sync_period: float) -> float:
    """How long a queued change may wait to be programmed: upstream's 2 x syncPeriod."""
    return 2.0 * sync_period


class ProxyHealth:
    """When the agent counts as healthy; see the module docstring."""

    def __init__(
        self,
        timeout: float,
        clock: Callable[[], float] = time.time,
        leftovers_pending: Callable[[], str] = lambda: "",
    ) -> None:
        self.timeout = timeout
        self.clock = clock
        # As upstream's sync loop does at its start: a first update that never succeeds
        # still reports a real lastUpdated.
        self.last_updated = clock()
        self.oldest_pending: float | None = None
        self.node_eligible = True
        self.first_sync_verified = False
        #: Why the old mode's rules are not removed yet ("" once they are, or none to wait for;
        #: the agent's leftover removal tells).
        self.leftovers_pending = leftovers_pending
        #: The rollback's reason once the agent went back to the mode before a switch.
        self.rolled_back = ""
        #: What is wrong with each dead watch (none: every watch is running); the agent's.
        self.dead_watches: Callable[[], list[str]] = list

    def queued_update(self) -> None:
        """A change is waiting to be programmed (a later one keeps the oldest time)."""
        if self.oldest_pending is None:
            self.oldest_pending = self.clock()

    def updated(self) -> None:
        """The kernel holds everything queued so far."""
        self.oldest_pending = None
        self.last_updated = self.clock()

    def verified_first_sync(self) -> None:
        """This agent's first full sync was programmed and found in the kernel."""
        self.first_sync_verified = True

    def sync_node(self, node: Obj | None) -> None:
        self.node_eligible = node_eligible(node)

    def healthy(self, now: float) -> bool:
        """Nothing pending, or the oldest pending change is not late yet (node ignored)."""
        return self.oldest_pending is None or now - self.oldest_pending < self.timeout

    def healthz(self) -> tuple[int, dict[str, object]]:
        """/healthz: (status code, JSON body) with upstream's fields."""
        now = self.clock()
        dead = self.dead_watches()
        ok = self.healthy(now) and self.node_eligible and not dead
        body: dict[str, object] = self._times(ok, now)
        body["nodeEligible"] = self.node_eligible
        if dead:
            body["deadWatches"] = dead
        return (200 if ok else 503), body

    def readyz(self) -> tuple[int, dict[str, object]]:
        """/readyz: `/healthz`, and not before the first verified sync and the removal of the
        other modes' rules, nor after a rollback."""
        code, body = self.healthz()
        body["firstSyncVerified"] = self.first_sync_verified
        why = (
            f"rolled back: {self.rolled_back}"
            if self.rolled_back
            else ""
            if self.first_sync_verified
            else "first sync not verified yet"
        )
        if not why:
            why = self.leftovers_pending()
        if why:
            body["notReady"] = why
            return 503, body
        return code, body

    def livez(self) -> tuple[int, dict[str, object]]:
        """/livez: the proxy's own health; a node being drained is still alive."""
        now = self.clock()
        dead = self.dead_watches()
        ok = self.healthy(now) and not dead
        body = self._times(ok, now)
        if dead:
            body["deadWatches"] = dead
        return (200 if ok else 503), body

    def alivez(self) -> tuple[int, dict[str, object]]:
        """/alivez (the liveness probe): 503 only for what a restart fixes, a dead watch; not
        for a change that waits (the kernel refusing it is not fixed by a restart)."""
        dead = self.dead_watches()
        body: dict[str, object] = {"currentTime": rfc3339(self.clock())}
        if dead:
            body["deadWatches"] = dead
        return (503 if dead else 200), body

    def _times(self, ok: bool, now: float) -> dict[str, object]:
        # Upstream reports lastUpdated = now while healthy (older clients read it as "the
        # sync loop is running"); the real last update when not.
        last = now if ok else self.last_updated
        return {"lastUpdated": rfc3339(last), "currentTime": rfc3339(now)}


def rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
