"""The Event an agent records about its own Pod, and its node's state (what the operator's
status reads)."""

from __future__ import annotations

from datetime import UTC, datetime

from kpx_agent.observability.node_state import NodeFacts, node_state_object, status_of
from kpx_agent.observability.pod_events import CONNTRACK_NOT_APPLIED, PodRef, event_body
from kpx_operator.agent_reports import NodeProblem, conntrack_problems


def test_pod_comes_from_the_downward_api_or_not_at_all() -> None:
    env = {"POD_NAME": "kpx-agent-default-x", "POD_NAMESPACE": "kpx-system", "POD_UID": "u1"}
    assert PodRef.from_env(env) == PodRef("kpx-agent-default-x", "kpx-system", "u1")
    assert PodRef.from_env({**env, "POD_UID": ""}) is None  # an agent started by hand


def test_event_about_the_pod_is_what_the_operator_reads() -> None:
    pod = PodRef("kpx-agent-default-x", "kpx-system", "u1")
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    body = event_body(pod, "n1", "Warning", CONNTRACK_NOT_APPLIED, "m" * 2000, now)
    assert body["metadata"] == {"generateName": "kpx-agent-default-x.", "namespace": "kpx-system"}
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "kpx-agent-default-x",
        "namespace": "kpx-system",
        "uid": "u1",
    }
    assert body["source"] == {"component": "kpx-agent", "host": "n1"}
    assert body["lastTimestamp"] == "2026-01-01T12:00:00Z" and len(body["message"]) == 1024


def test_the_node_state_the_agent_writes_is_what_the_operator_reads() -> None:
    """The agent's and the operator's halves agree (they share only kpx_api's models)."""
    facts = NodeFacts(
        mode="nftables",
        agent_version="0.1.0",
        pod=("kpx-agent-default-x", "kpx-system", "u1"),
        conntrack_not_applied="m" * 2000,
    )
    obj = {**node_state_object("n1", "node-uid"), "status": status_of(facts)}
    pods = [{"metadata": {"uid": "u1"}, "spec": {"nodeName": "n1"}}]
    said = "conntrack settings not applied: " + "m" * 1021 + "..."
    assert conntrack_problems(pods, [obj]) == (NodeProblem("n1", said),)
