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
from kpx_api.nodestate import ProxyNodeStateStatus

T0 = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
FACTS = NodeFacts(mode="nftables", agent_version="0.1.0", pod=("a", "kpx-system", "u1"),
                  generation=4, verified=True, last_sync=SyncRecord(T0, 0.5, True),
                  services=10, endpoints=20, rules=90)  # fmt: skip


def synced_at(facts: NodeFacts, seconds: float, duration: float = 0.1) -> NodeFacts:
    return replace(facts, last_sync=SyncRecord(T0 + timedelta(seconds=seconds), duration, True))


def test_the_status_is_what_the_crd_accepts() -> None:
    status = status_of(replace(FACTS, last_error=ErrorRecord("x" * 5000, T0),
                               leftovers=(("iptables", "waiting"),)))  # fmt: skip
    parsed = ProxyNodeStateStatus.model_validate(status)
    assert parsed.configuration_generation == 4 and parsed.programmed is not None
    assert parsed.last_error is not None and len(parsed.last_error.message) == 1024
    assert status["lastSync"] == {"time": "2026-11-26T12:00:00Z", "durationSeconds": 0.5,
                                  "full": True}  # fmt: skip


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
        replace(FACTS, mode="iptables"), replace(FACTS, generation=5),
        replace(FACTS, verified=False), replace(FACTS, rolled_back="went back"),
        replace(FACTS, rules=91), replace(FACTS, last_error=ErrorRecord("boom", T0)),
        replace(FACTS, leftovers=(("ipvs", ""),)), replace(FACTS, pod=("b", "kpx-system", "u2")),
        replace(FACTS, last_sync=SyncRecord(T0, 0.5, False)),
    ):  # fmt: skip
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
