"""The agent's health as upstream kube-proxy decides it: pure timing, the clock passed in."""

from __future__ import annotations

from typing import Any

from kpx_agent.observability.proxy_health import (
    TO_BE_DELETED_TAINT,
    ProxyHealth,
    health_timeout,
    node_eligible,
    rfc3339,
)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def health(timeout: float = 60.0) -> tuple[ProxyHealth, Clock]:
    clock = Clock()
    return ProxyHealth(timeout, clock), clock


def node(taints: list[dict[str, str]] | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "n1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"taints": taints or []}}


def test_timeout_is_twice_the_sync_period_as_upstream() -> None:
    assert health_timeout(30.0) == 60.0
    assert health_timeout(2.0) == 4.0


def test_idle_agent_stays_healthy_however_long_ago_it_synced() -> None:
    h, clock = health()
    h.updated()
    clock.now += 3600  # an hour without any change
    assert h.healthz()[0] == 200
    assert h.livez()[0] == 200


def test_healthy_body_reports_now_as_last_updated() -> None:
    h, clock = health()
    clock.now += 100
    code, body = h.healthz()
    assert code == 200
    assert body == {
        "lastUpdated": rfc3339(clock.now),
        "currentTime": rfc3339(clock.now),
        "nodeEligible": True,
    }
    assert set(h.livez()[1]) == {"lastUpdated", "currentTime"}


def test_queued_change_not_programmed_within_the_timeout_is_unhealthy() -> None:
    h, clock = health(timeout=4.0)
    started = clock.now
    clock.now += 10
    h.queued_update()
    clock.now += 3.9
    assert h.healthz()[0] == 200 and h.livez()[0] == 200  # pending, not late yet
    clock.now += 0.1
    code, body = h.healthz()
    assert code == 503 and h.livez()[0] == 503
    assert body["lastUpdated"] == rfc3339(started)  # the real last update once unhealthy
    assert body["nodeEligible"] is True
    h.updated()
    assert h.healthz()[0] == 200 and h.livez()[0] == 200


def test_a_later_change_keeps_the_oldest_pending_time() -> None:
    h, clock = health(timeout=4.0)
    h.queued_update()
    clock.now += 3
    h.queued_update()  # e.g. a failed sync re-queued everything
    clock.now += 1.5
    assert h.livez()[0] == 503


def test_programmed_change_within_the_timeout_stays_healthy() -> None:
    h, clock = health(timeout=4.0)
    for _ in range(10):
        h.queued_update()
        clock.now += 3
        h.updated()
        clock.now += 3
        assert h.healthz()[0] == 200


def test_node_being_deleted_or_tainted_fails_healthz_only() -> None:
    h, _ = health()
    for not_eligible in (node(deleting=True), node([{"key": TO_BE_DELETED_TAINT}])):
        h.sync_node(not_eligible)
        code, body = h.healthz()
        assert code == 503 and body["nodeEligible"] is False
        assert h.livez()[0] == 200
    h.sync_node(node([{"key": "other", "effect": "NoSchedule"}]))
    code, body = h.healthz()
    assert code == 200 and body["nodeEligible"] is True


def test_node_eligibility() -> None:
    assert node_eligible(None)  # not known yet: eligible, as upstream at start-up
    assert node_eligible(node())
    assert node_eligible({"metadata": {"name": "n1"}})
    assert not node_eligible(node(deleting=True))
    assert not node_eligible(node([{"key": "a"}, {"key": TO_BE_DELETED_TAINT}]))


def test_readyz_waits_for_the_first_verified_sync_then_follows_healthz() -> None:
    h, clock = health(timeout=60.0)
    # /healthz is 200 before the first sync (as upstream); /readyz is not.
    assert h.healthz()[0] == 200
    code, body = h.readyz()
    assert (code, body["firstSyncVerified"]) == (503, False)
    h.verified_first_sync()
    assert h.readyz() == (200, {**h.healthz()[1], "firstSyncVerified": True})
    # Afterwards it fails with /healthz: a change left unprogrammed past the timeout...
    h.queued_update()
    clock.now += 61
    assert h.healthz()[0] == 503 and h.readyz()[0] == 503
    h.updated()
    assert h.readyz()[0] == 200
    # ... and a node that is not eligible for traffic.
    h.sync_node(node(deleting=True))
    assert h.readyz()[0] == 503


def test_a_dead_watch_fails_healthz_livez_and_alivez() -> None:
    h, _ = health()
    dead: list[str] = []
    h.dead_watches = lambda: list(dead)
    assert [h.healthz()[0], h.livez()[0], h.alivez()[0]] == [200, 200, 200]
    dead.append("services: BadEvent: ...")
    for code, body in (h.healthz(), h.livez(), h.alivez()):
        assert code == 503
        assert body["deadWatches"] == ["services: BadEvent: ..."]
    dead.clear()  # the reflector listed again
    assert [h.healthz()[0], h.livez()[0], h.alivez()[0]] == [200, 200, 200]


def test_alivez_ignores_a_change_the_kernel_keeps_refusing_and_a_draining_node() -> None:
    """A poison object: the change waits for ever. /livez says so (upstream's semantics), the
    liveness probe's /alivez does not: a restart would not program it either."""
    h, clock = health(timeout=60.0)
    h.queued_update()
    clock.now += 3600
    h.sync_node(node(deleting=True))
    assert h.livez()[0] == 503 and h.healthz()[0] == 503
    assert h.alivez() == (200, {"currentTime": rfc3339(clock.now)})
