"""spec.takeover on the operator's side: each node's phase from its current agent's Events,
kube-proxy's DaemonSet kept off the nodes kpx serves (moveKubeProxyOff), the status and the
Events - the pure parts, and the reconcile pass against an in-memory apiserver."""

from __future__ import annotations

from typing import Any

from test_operator_reconciler import (
    NS,
    Events,
    FakeApi,
    agent_event,
    agent_pod,
    body,
    reconciler,
    run,
)

from kpx_api.takeover import KUBE_PROXY_OFF_LABEL, Takeover, TakeoverPhase
from kpx_operator.takeover import (
    affinity_patch,
    node_phases,
    nodes_to_label,
    takeover_status,
)

P = TakeoverPhase
EXCLUDE = {"key": KUBE_PROXY_OFF_LABEL, "operator": "DoesNotExist"}
OTHER_MODE = "could not remove the rules of kpx mode ipvs (retrying): x"
LEFTOVERS_KP = "could not remove upstream kube-proxy's rules (retrying): xtables lock"


def test_phases_come_from_the_current_agent_pods_furthest_event() -> None:
    pods = [agent_pod("u1", "n1"), agent_pod("u2", "n2"), agent_pod("u3", "n3"),
            agent_pod("u4", "n4"), agent_pod("u5", "n5")]  # fmt: skip
    events = [
        agent_event("u1", "FirstSyncVerified", "2026-01-01T00:00:01Z"),
        agent_event("u1", "WaitingForKubeProxy", "2026-01-01T00:00:02Z", "a Pod of kube-proxy"),
        agent_event("u2", "FirstSyncVerified", "2026-01-01T00:00:01Z"),
        agent_event("u2", "KubeProxyRulesRemoved", "2026-01-01T00:00:03Z", "removed"),
        agent_event("u3", "FirstSyncVerified", "2026-01-01T00:00:01Z"),
        agent_event("u3", "LeftoversNotRemoved", "2026-01-01T00:00:02Z", LEFTOVERS_KP),
        # Another kind of leftover failing is no takeover failure.
        agent_event("u4", "FirstSyncVerified", "2026-01-01T00:00:01Z"),
        agent_event("u4", "LeftoversNotRemoved", "2026-01-01T00:00:02Z", OTHER_MODE),
        # A Pod that is gone (replaced) no longer counts: n5's current agent has said nothing.
        agent_event("u-old", "KubeProxyRulesRemoved", "2026-01-01T00:00:01Z"),
    ]
    foreign = agent_event("u5", "KubeProxyRulesRemoved", "2026-01-01T00:00:09Z")
    foreign["source"] = {"component": "someone-else"}
    phases = node_phases(pods, [*events, foreign])
    assert {n: p for n, (p, _) in phases.items()} == {
        "n1": P.WAITING_FOR_KUBE_PROXY,
        "n2": P.KUBE_PROXY_RULES_REMOVED,
        "n3": P.REMOVAL_FAILING,
        "n4": P.AGENT_READY,
        "n5": P.AGENT_NOT_READY,
    }
    assert phases["n3"][1] == LEFTOVERS_KP


def test_only_served_nodes_without_the_label_are_labelled() -> None:
    phases = {"n1": (P.AGENT_READY, ""), "n2": (P.AGENT_NOT_READY, ""),
              "n3": (P.KUBE_PROXY_RULES_REMOVED, ""), "gone": (P.AGENT_READY, "")}  # fmt: skip
    labels = {"n1": {}, "n2": {}, "n3": {KUBE_PROXY_OFF_LABEL: "true"}}
    assert nodes_to_label(phases, labels) == ["n1"]


def kube_proxy_ds(affinity: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "kube-proxy"}]}
    if affinity is not None:
        spec["affinity"] = affinity
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system",
                         "resourceVersion": "7"},
            "spec": {"template": {"spec": spec}}}  # fmt: skip


def terms_of(patch: dict[str, Any]) -> list[dict[str, Any]]:
    node_affinity = patch["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms: list[dict[str, Any]] = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    return terms


def test_affinity_patch_excludes_labelled_nodes_in_every_term_once() -> None:
    patch = affinity_patch(kube_proxy_ds())
    assert patch is not None and terms_of(patch) == [{"matchExpressions": [EXCLUDE]}]
    assert patch["metadata"] == {"resourceVersion": "7"}  # a concurrent change: Conflict
    linux = {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}
    arm = {"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}
    ds = kube_proxy_ds(
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [linux]},
                        {"matchExpressions": [arm]},
                    ]
                }
            }
        }
    )
    patch = affinity_patch(ds)
    assert patch is not None
    assert terms_of(patch) == [{"matchExpressions": [linux, EXCLUDE]},
                               {"matchExpressions": [arm, EXCLUDE]}]  # fmt: skip
    done = kube_proxy_ds(patch["spec"]["template"]["spec"]["affinity"])
    assert affinity_patch(done) is None


def test_status_summary_counts_each_phase() -> None:
    phases = {"n1": (P.KUBE_PROXY_RULES_REMOVED, "removed"), "n2": (P.WAITING_FOR_KUBE_PROXY, ""),
              "n3": (P.KUBE_PROXY_RULES_REMOVED, "")}  # fmt: skip
    status = takeover_status(phases, {"n2": {KUBE_PROXY_OFF_LABEL: "true"}})
    assert status.done == 2
    assert status.summary == ("2 of 3 nodes taken over from kube-proxy "
                              "(1 WaitingForKubeProxy, 2 KubeProxyRulesRemoved)")  # fmt: skip
    assert [(n.name, n.kube_proxy_off) for n in status.nodes] == [
        ("n1", False), ("n2", True), ("n3", False)]  # fmt: skip


def test_move_kube_proxy_off_needs_from_kube_proxy() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="moveKubeProxyOff needs fromKubeProxy"):
        Takeover(move_kube_proxy_off=True)
    assert Takeover(from_kube_proxy=True, move_kube_proxy_off=True).move_kube_proxy_off


# -- the reconcile pass ---------------------------------------------------------------------------


def cluster() -> tuple[FakeApi, dict[str, dict[str, str]]]:
    api = FakeApi()
    api.ds_status["kpx-agent-default"] = {"desiredNumberScheduled": 2, "numberReady": 2,
                                          "updatedNumberScheduled": 2}  # fmt: skip
    api.objs[("DaemonSet", "kube-system", "kube-proxy")] = kube_proxy_ds()
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}}
    for uid, node in (("u1", "n1"), ("u2", "n2")):
        api.objs[("Pod", NS, uid)] = agent_pod(uid, node)
        api.objs[("Node", None, node)] = {"kind": "Node", "metadata": {"name": node}}
    return api, nodes


TAKEOVER = {"fromKubeProxy": True, "moveKubeProxyOff": True}


def test_kube_proxy_is_moved_off_node_by_node_as_agents_become_ready() -> None:
    api, nodes = cluster()
    events = Events()
    r = reconciler(api)
    # No agent has verified its first sync yet: nothing is touched.
    status = run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert api.patches == []
    assert [(n.name, n.phase) for n in status.takeover.nodes] == [
        ("n1", P.AGENT_NOT_READY), ("n2", P.AGENT_NOT_READY)]  # fmt: skip
    # n1's agent serves: the DaemonSet gets the affinity once, n1 the label; n2 is left alone.
    api.objs[("Event", NS, "a")] = agent_event("u1", "FirstSyncVerified", "2026-01-01T00:00:01Z")
    status = run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert [(k, n) for k, n, _ in api.patches] == [("DaemonSet", "kube-proxy"), ("Node", "n1")]
    ds = api.objs[("DaemonSet", "kube-system", "kube-proxy")]
    assert affinity_patch(ds) is None
    assert api.objs[("Node", None, "n1")]["metadata"]["labels"] == {KUBE_PROXY_OFF_LABEL: "true"}
    assert "labels" not in api.objs[("Node", None, "n2")]["metadata"]
    assert [(n.name, n.phase, n.kube_proxy_off) for n in status.takeover.nodes] == [
        ("n1", P.AGENT_READY, True), ("n2", P.AGENT_NOT_READY, False)]  # fmt: skip
    assert {"AgentReady", "KubeProxyAffinityPatched", "KubeProxyMovedOff"} <= set(events.reasons())
    # The next pass (the node index now has the label) patches nothing again.
    nodes["n1"] = {KUBE_PROXY_OFF_LABEL: "true"}
    before = len(api.patches)
    events.clear()
    api.objs[("Event", NS, "b")] = agent_event("u1", "KubeProxyRulesRemoved",
                                               "2026-01-01T00:00:09Z", "removed")  # fmt: skip
    status = run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert len(api.patches) == before
    assert events == [("Normal", "KubeProxyRulesRemoved", "node n1: removed")]
    assert status.takeover.summary == ("1 of 2 nodes taken over from kube-proxy "
                                       "(1 AgentNotReady, 1 KubeProxyRulesRemoved)")  # fmt: skip


def test_without_move_kube_proxy_off_nothing_is_patched_but_progress_shows() -> None:
    api, nodes = cluster()
    events = Events()
    api.objs[("Event", NS, "a")] = agent_event("u1", "WaitingForKubeProxy", "2026-01-01T00:00:01Z")
    status = run(reconciler(api).reconcile(body(takeover={"fromKubeProxy": True}), [], nodes,
                                           events))  # fmt: skip
    assert api.patches == []
    assert status.takeover.nodes[0].phase == P.WAITING_FOR_KUBE_PROXY
    # Without fromKubeProxy there is no takeover status at all.
    status = run(reconciler(api).reconcile(body(), [], nodes, events))
    assert status.takeover is None


def test_a_missing_kube_proxy_daemonset_is_said_once() -> None:
    api, nodes = cluster()
    del api.objs[("DaemonSet", "kube-system", "kube-proxy")]
    api.objs[("Event", NS, "a")] = agent_event("u1", "FirstSyncVerified", "2026-01-01T00:00:01Z")
    events = Events()
    r = reconciler(api)
    for _ in range(2):
        run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert events.reasons().count("KubeProxyNotFound") == 1 and api.patches == []


def test_deleting_the_configuration_moves_kube_proxy_back_first() -> None:
    api, nodes = cluster()
    events = Events()
    r = reconciler(api)
    run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    api.objs[("Node", None, "n1")]["metadata"]["labels"] = {KUBE_PROXY_OFF_LABEL: "true"}
    nodes["n1"] = {KUBE_PROXY_OFF_LABEL: "true"}
    try:
        run(r.finalize(body(takeover=TAKEOVER), [], nodes, 0, events))
    except Exception as exc:  # NotYet: waits for the agents to stop
        assert "waiting" in str(exc)
    assert api.objs[("Node", None, "n1")]["metadata"]["labels"] == {}
    assert "KubeProxyMovedBack" in events.reasons()
    assert events.reasons().index("KubeProxyMovedBack") < events.reasons().index("StoppingAgents")
