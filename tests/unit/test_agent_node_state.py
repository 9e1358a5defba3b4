"""Pure: the ProxyNodeState an agent writes, and when (kpx_agent.observability.node_state)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from kpx_agent.observability.node_state import (
    ErrorRecord,
    NodeFacts,
    SyncRecord,
    WriteGate,
    node_state_object,
    status_of,
)
from kpx_api.nodestate import LeftoverKind, LeftoverState, PendingLeftover, ProxyNodeStateStatus
from kpx_api.preflight import ModeCheck

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
KP, KPX = LeftoverKind.KUBE_PROXY, LeftoverKind.KPX_MODE
WAITING = PendingLeftover(
    name="kube-proxy", kind=KP, state=LeftoverState.WAITING, message="a Pod of kube-proxy runs here"
)
FACTS = NodeFacts(
    mode="nftables",
    agent_version="0.1.0",
    pod=("a", "kpx-system", "u1"),
    generation=4,
    verified=True,
    last_sync=SyncRecord(T0, 0.5, True),
    services=10,
    endpoints=20,
    rules=90,
)


def synced_at(facts: NodeFacts, seconds: float, duration: float = 0.1) -> NodeFacts:
    return replace(facts, last_sync=SyncRecord(T0 + timedelta(seconds=seconds), duration, True))


def test_the_status_is_what_the_crd_accepts() -> None:
    leftovers = tuple(PendingLeftover(name=f"m{i}", kind=KPX) for i in range(9))
    checks = [ModeCheck("nftables", True, "v" * 500), ModeCheck("ipvs", False, "no ip_vs")]
    status = status_of(
        replace(
            FACTS,
            last_error=ErrorRecord("x" * 5000, T0),
            leftovers=(WAITING, *leftovers),
            preflight=checks,
            takeover_from_kube_proxy=True,
        )
    )
    parsed = ProxyNodeStateStatus.model_validate(status)
    assert parsed.configuration_generation == 4 and parsed.programmed is not None
    assert parsed.last_error is not None and len(parsed.last_error.message) == 1024
    # Within the CRD's bounds: 8 leftovers, 280 characters of a verdict's detail.
    assert len(parsed.leftovers_pending) == 8 and parsed.takeover_from_kube_proxy
    first = parsed.leftovers_pending[0]
    assert (first.name, first.kind, first.state) == ("kube-proxy", KP, LeftoverState.WAITING)
    assert [(v.mode, v.ok) for v in parsed.preflight] == [("nftables", True), ("ipvs", False)]
    assert len(parsed.preflight[0].detail) == 280 and parsed.preflight[1].detail == "no ip_vs"
    assert status["lastSync"] == {
        "time": "2026-11-26T12:00:00Z",
        "durationSeconds": 0.5,
        "full": True,
    }


def test_first_status_is_written_at_once_then_only_on_change() -> None:
    gate = WriteGate(10)
    assert gate.wait(status_of(FACTS), 0.0) == 0.0
    gate.wrote(status_of(FACTS), 0.0)
    # A sync that changes nothing but its time and duration is no news.
    assert gate.wait(status_of(synced_at(FACTS, 30, 2.0)), 30.0) is None
    # A change 3 s after a write waits for the end of the interval.
    changed = status_of(replace(FACTS, endpoints=21))
    assert gate.wait(changed, 3.0) == pytest.approx(7.0)
    assert gate.wait(changed, 12.0) == 0.0
    gate.wrote(changed, 12.0)
    assert gate.wait(status_of(replace(FACTS, endpoints=22)), 12.5) == pytest.approx(9.5)


def test_every_field_but_the_sync_time_counts_as_a_change() -> None:
    gate = WriteGate(1)
    gate.wrote(status_of(FACTS), 0.0)
    for changed in (
        replace(FACTS, mode="iptables"),
        replace(FACTS, generation=5),
        replace(FACTS, verified=False),
        replace(FACTS, rolled_back="went back"),
        replace(FACTS, rules=91),
        replace(FACTS, last_error=ErrorRecord("boom", T0)),
        replace(FACTS, leftovers=(WAITING,)),
        replace(FACTS, pod=("b", "kpx-system", "u2")),
        replace(FACTS, leftovers=(WAITING.model_copy(update={"state": LeftoverState.FAILING}),)),
        replace(FACTS, takeover_from_kube_proxy=True),
        replace(FACTS, preflight=(ModeCheck("ipvs", True),)),
        replace(FACTS, last_sync=SyncRecord(T0, 0.5, False)),
    ):
        assert gate.wait(status_of(changed), 5.0) == 0.0, changed


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be above 0"):
        WriteGate(0)


def test_the_object_is_owned_by_its_node() -> None:
    obj = node_state_object("n1", "uid-n1")
    assert obj["metadata"]["name"] == "n1" and "status" not in obj
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-n1"}
    ]
    assert "ownerReferences" not in node_state_object("n1", None)["metadata"]


@pytest.mark.parametrize("ticks", [0, 1, 2, 3])
def test_the_writer_stops_when_cancelled_as_it_is_poked(ticks: int) -> None:
    """The agent cancels the writer at shutdown; a poke at that moment must not swallow the
    cancellation (asyncio.wait_for does on Python 3.11), or the agent never stops."""
    import asyncio

    from kpx_agent.observability.node_state_writer import NodeStateWriter

    async def scenario() -> None:
        writer = NodeStateWriter(object(), "n1", lambda: FACTS, interval=30)  # type: ignore[arg-type]
        writer.gate.wrote(status_of(FACTS), 0.0)  # nothing new to write: no request
        task = asyncio.create_task(writer.run())
        await asyncio.sleep(0.01)
        writer.poke()
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        assert task in done and task.cancelled()

    asyncio.run(scenario())
