"""deletionPolicy Cleanup, the pure part: which node does what on one pass (cleanup.py)."""

from __future__ import annotations

from kpx_api.takeover import KUBE_PROXY_OFF_LABEL
from kpx_operator.cleanup import (
    CLEANUP_LABEL,
    DELETING_LABEL,
    NodeState,
    marks_patch,
    node_states,
    plan,
    waiting_summary,
)

SERVING = NodeState(agent=True)


def test_at_most_window_nodes_are_in_their_turn() -> None:
    nodes = {"a": SERVING, "b": SERVING, "c": SERVING}
    p = plan(nodes, 2, wait_for_kube_proxy=False)
    assert p.begin == ("a", "b") and p.stop_agent == ("a", "b") and p.pending == ("c",)
    assert not p.finished and p.total == 3


def test_each_step_of_a_node() -> None:
    nodes = {
        "stopping": NodeState(agent_stopping=True, deleting=True),
        "stopped": NodeState(deleting=True),
        "cleaning": NodeState(deleting=True, cleaning=True),
        "clean": NodeState(deleting=True, cleaning=True, clean=True),
        "next": SERVING,
    }
    p = plan(nodes, 3, wait_for_kube_proxy=False)
    assert p.begin == () and p.pending == ("next",)  # three in their turn already
    assert p.stop_agent == () and p.clean == ("stopped",) and p.done == ("clean",)
    assert p.waiting == {
        "stopping": "its agent is stopping",
        "stopped": "its cleanup Pod is not Ready yet",
        "cleaning": "its cleanup Pod is not Ready yet",
    }
    assert waiting_summary(p).startswith("1 of 5 nodes clean; cleaning: its cleanup Pod")


def test_kube_proxy_comes_back_and_is_ready_before_the_agent_stops() -> None:
    nodes = {
        "off": NodeState(agent=True, kube_proxy_off=True),
        "back": NodeState(agent=True, deleting=True),
        "ready": NodeState(agent=True, deleting=True, kube_proxy_ready=True),
    }
    p = plan(nodes, 3, wait_for_kube_proxy=True)
    assert p.move_back == ("off",) and p.stop_agent == ("ready",)
    assert p.waiting["back"] == "kube-proxy's Pod there is not Ready yet"
    # Without kube-proxy's DaemonSet (or moveKubeProxyOff) there is nothing to wait for.
    assert plan(nodes, 3, wait_for_kube_proxy=False).stop_agent == ("back", "off", "ready")


def test_finished_once_every_node_is_clean() -> None:
    assert plan({}, 1, wait_for_kube_proxy=False).finished
    assert plan({"a": NodeState(cleaning=True, clean=True)}, 1, wait_for_kube_proxy=False).finished


def pod(node: str, *, ready: bool = True, terminating: bool = False) -> dict[str, object]:
    meta: dict[str, object] = {"name": f"p-{node}"}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_states_from_pods_and_labels() -> None:
    marked = [
        {"metadata": {"name": "m1", "labels": {DELETING_LABEL: "x", CLEANUP_LABEL: "x"}}},
        {"metadata": {"name": "m2", "labels": {DELETING_LABEL: "other"}}},
    ]
    states = node_states(
        "x",
        [pod("a"), pod("b", terminating=True), {"spec": {}}],  # a Pod not scheduled: no node
        [pod("m1")],
        marked,
        [pod("a", ready=False), pod("b")],
        {"a": {KUBE_PROXY_OFF_LABEL: "true"}, "m1": {}},
    )
    assert states == {
        "a": NodeState(agent=True, kube_proxy_off=True),
        "b": NodeState(agent_stopping=True, kube_proxy_ready=True),
        "m1": NodeState(deleting=True, cleaning=True, clean=True),
    }  # m2 carries another configuration's label: not one of ours
    assert marks_patch() == {"metadata": {"labels": {DELETING_LABEL: None, CLEANUP_LABEL: None}}}
