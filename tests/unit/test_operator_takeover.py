"""spec.takeover on the operator's side: each node's phase from the ProxyNodeState its current
agent wrote, kube-proxy's DaemonSet kept off the nodes kpx serves (moveKubeProxyOff), the status
and the Events - the pure parts, and the reconcile pass against an in-memory apiserver."""

from __future__ import annotations

from typing import Any

import pytest
from test_operator_reconciler import (
    NS,
    Events,
    FakeApi,
    NotYet,
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
LEFTOVERS_KP = "could not remove upstream kube-proxy's rules (retrying): xtables lock"
WAIT_KP = "a Pod of kube-system/kube-proxy runs on this node"


def state(
    uid: str,
    node: str,
    verified: bool = True,
    takeover: bool = True,
    **pending: tuple[str, str, str],
) -> dict[str, Any]:
    """The ProxyNodeState of `node` as agent Pod `uid` wrote it; `pending`: name -> (kind,
    state, message) of leftoversPending."""
    leftovers = [
        {"name": n, "kind": k, "state": st, "message": m} for n, (k, st, m) in pending.items()
    ]
    return {
        "metadata": {"name": node},
        "status": {
            "mode": "nftables",
            "firstSyncVerified": verified,
            "takeoverFromKubeProxy": takeover,
            "leftoversPending": leftovers,
            "agentPod": {"name": f"p-{uid}", "uid": uid},
        },
    }


def kube_proxy(state_: str, message: str = "") -> tuple[str, str, str]:
    return ("KubeProxy", state_, message)


def test_phases_come_from_the_current_agent_pods_node_state() -> None:
    pods = [agent_pod(f"u{i}", f"n{i}") for i in range(1, 9)]
    states = [
        state("u1", "n1", **{"kube-proxy": kube_proxy("Waiting", WAIT_KP)}),
        state("u2", "n2"),  # verified, kube-proxy's rules no longer pending: removed
        state("u3", "n3", **{"kube-proxy": kube_proxy("Failing", LEFTOVERS_KP)}),
        # Another kind of leftover failing is no takeover failure; kube-proxy's not tried yet.
        state(
            "u4",
            "n4",
            ipvs=("KpxMode", "Failing", "could not remove ipvs (retrying): x"),
            **{"kube-proxy": kube_proxy("Pending")},
        ),
        # Not verified yet: whatever else it says, the agent does not serve.
        state("u5", "n5", verified=False, **{"kube-proxy": kube_proxy("Waiting")}),
        # An agent of a configuration without spec.takeover: it serves, nothing removed.
        state("u6", "n6", takeover=False),
        # Written by a Pod that is gone (n7's current agent wrote nothing), or about another
        # node than its Pod's.
        state("u-old", "n7"),
        state("u8", "n1"),
    ]
    phases = node_phases(pods, states)
    assert {n: p for n, (p, _) in phases.items()} == {
        "n1": P.WAITING_FOR_KUBE_PROXY,
        "n2": P.KUBE_PROXY_RULES_REMOVED,
        "n3": P.REMOVAL_FAILING,
        "n4": P.AGENT_READY,
        "n5": P.AGENT_NOT_READY,
        "n6": P.AGENT_READY,
        "n7": P.AGENT_NOT_READY,
        "n8": P.AGENT_NOT_READY,
    }
    assert phases["n1"][1] == WAIT_KP and phases["n3"][1] == LEFTOVERS_KP
    assert phases["n2"][1] == "removed upstream kube-proxy's rules"


def test_only_served_nodes_without_the_label_are_labelled() -> None:
    phases = {
        "n1": (P.AGENT_READY, ""),
        "n2": (P.AGENT_NOT_READY, ""),
        "n3": (P.KUBE_PROXY_RULES_REMOVED, ""),
        "gone": (P.AGENT_READY, ""),
    }
    labels = {"n1": {}, "n2": {}, "n3": {KUBE_PROXY_OFF_LABEL: "true"}}
    assert nodes_to_label(phases, labels) == ["n1"]


def kube_proxy_ds(affinity: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "kube-proxy"}]}
    if affinity is not None:
        spec["affinity"] = affinity
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "kube-proxy", "namespace": "kube-system", "resourceVersion": "7"},
        "spec": {"template": {"spec": spec}},
    }


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
    assert terms_of(patch) == [
        {"matchExpressions": [linux, EXCLUDE]},
        {"matchExpressions": [arm, EXCLUDE]},
    ]
    done = kube_proxy_ds(patch["spec"]["template"]["spec"]["affinity"])
    assert affinity_patch(done) is None


def test_status_summary_counts_each_phase() -> None:
    phases = {
        "n1": (P.KUBE_PROXY_RULES_REMOVED, "removed"),
        "n2": (P.WAITING_FOR_KUBE_PROXY, ""),
        "n3": (P.KUBE_PROXY_RULES_REMOVED, ""),
    }
    status = takeover_status(phases, {"n2": {KUBE_PROXY_OFF_LABEL: "true"}})
    assert status.done == 2
    assert status.summary == (
        "2 of 3 nodes taken over from kube-proxy (1 WaitingForKubeProxy, 2 KubeProxyRulesRemoved)"
    )
    assert [(n.name, n.kube_proxy_off) for n in status.nodes] == [
        ("n1", False),
        ("n2", True),
        ("n3", False),
    ]


def test_status_lists_at_most_the_crds_limit_furthest_behind_first() -> None:
    from kpx_operator import takeover

    phases = {f"n{i:05}": (P.KUBE_PROXY_RULES_REMOVED, "") for i in range(takeover.MAX_LISTED)}
    phases["late"] = (P.AGENT_NOT_READY, "")
    status = takeover_status(phases, {})
    assert len(status.nodes) == takeover.MAX_LISTED and "late" in {n.name for n in status.nodes}
    assert status.done == takeover.MAX_LISTED
    assert status.summary.startswith(f"{takeover.MAX_LISTED} of {takeover.MAX_LISTED + 1} ")


def test_move_kube_proxy_off_needs_from_kube_proxy() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="moveKubeProxyOff needs fromKubeProxy"):
        Takeover(move_kube_proxy_off=True)
    assert Takeover(from_kube_proxy=True, move_kube_proxy_off=True).move_kube_proxy_off


# -- the reconcile pass ---------------------------------------------------------------------------


def cluster() -> tuple[FakeApi, dict[str, dict[str, str]]]:
    api = FakeApi()
    api.ds_status["kpx-agent-default"] = {
        "desiredNumberScheduled": 2,
        "numberReady": 2,
        "updatedNumberScheduled": 2,
    }
    api.objs[("DaemonSet", "kube-system", "kube-proxy")] = kube_proxy_ds()
    nodes: dict[str, dict[str, str]] = {"n1": {}, "n2": {}}
    for uid, node in (("u1", "n1"), ("u2", "n2")):
        pod = agent_pod(uid, node)
        api.objs[("Pod", NS, pod["metadata"]["name"])] = pod
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
        ("n1", P.AGENT_NOT_READY),
        ("n2", P.AGENT_NOT_READY),
    ]
    # n1's agent serves: the DaemonSet gets the affinity once, n1 the label; n2 is left alone.
    api.objs[("ProxyNodeState", None, "n1")] = state(
        "u1", "n1", **{"kube-proxy": kube_proxy("Pending")}
    )
    status = run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert [(k, n) for k, n, _ in api.patches] == [("DaemonSet", "kube-proxy"), ("Node", "n1")]
    ds = api.objs[("DaemonSet", "kube-system", "kube-proxy")]
    assert affinity_patch(ds) is None
    assert api.objs[("Node", None, "n1")]["metadata"]["labels"] == {KUBE_PROXY_OFF_LABEL: "true"}
    assert "labels" not in api.objs[("Node", None, "n2")]["metadata"]
    assert [(n.name, n.phase, n.kube_proxy_off) for n in status.takeover.nodes] == [
        ("n1", P.AGENT_READY, True),
        ("n2", P.AGENT_NOT_READY, False),
    ]
    assert {"AgentReady", "KubeProxyAffinityPatched", "KubeProxyMovedOff"} <= set(events.reasons())
    # The next pass (the node index now has the label) patches nothing again.
    nodes["n1"] = {KUBE_PROXY_OFF_LABEL: "true"}
    before = len(api.patches)
    events.clear()
    api.objs[("ProxyNodeState", None, "n1")] = state("u1", "n1")
    status = run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert len(api.patches) == before
    assert events == [
        ("Normal", "KubeProxyRulesRemoved", "node n1: removed upstream kube-proxy's rules")
    ]
    assert status.takeover.summary == (
        "1 of 2 nodes taken over from kube-proxy (1 AgentNotReady, 1 KubeProxyRulesRemoved)"
    )


def test_without_move_kube_proxy_off_nothing_is_patched_but_progress_shows() -> None:
    api, nodes = cluster()
    events = Events()
    api.objs[("ProxyNodeState", None, "n1")] = state(
        "u1", "n1", **{"kube-proxy": kube_proxy("Waiting", WAIT_KP)}
    )
    status = run(
        reconciler(api).reconcile(body(takeover={"fromKubeProxy": True}), [], nodes, events)
    )
    assert api.patches == []
    assert status.takeover.nodes[0].phase == P.WAITING_FOR_KUBE_PROXY
    # Without fromKubeProxy there is no takeover status at all.
    status = run(reconciler(api).reconcile(body(), [], nodes, events))
    assert status.takeover is None


def test_a_missing_kube_proxy_daemonset_is_said_once() -> None:
    api, nodes = cluster()
    del api.objs[("DaemonSet", "kube-system", "kube-proxy")]
    api.objs[("ProxyNodeState", None, "n1")] = state("u1", "n1")
    events = Events()
    r = reconciler(api)
    for _ in range(2):
        run(r.reconcile(body(takeover=TAKEOVER), [], nodes, events))
    assert events.reasons().count("KubeProxyNotFound") == 1 and api.patches == []


def kube_proxy_pod(node: str, ready: bool) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"kube-proxy-{node}",
            "namespace": "kube-system",
            "labels": {"k8s-app": "kube-proxy"},
        },
        "spec": {"nodeName": node},
        "status": {"conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_a_cleanup_removes_a_nodes_rules_only_once_kube_proxy_is_ready_there() -> None:
    """Issue #22: deleting used to move kube-proxy back to every node and stop every agent at
    once, without waiting for kube-proxy to serve."""
    api, nodes = cluster()
    api.objs[("DaemonSet", "kube-system", "kube-proxy")]["spec"]["selector"] = {
        "matchLabels": {"k8s-app": "kube-proxy"}
    }
    events = Events()
    r = reconciler(api)
    pxc = body(takeover=TAKEOVER, deletionPolicy="Cleanup", maxUnavailable=1)
    run(r.reconcile(pxc, [], nodes, events))
    for node in ("n1", "n2"):
        api.objs[("Node", None, node)]["metadata"]["labels"] = {KUBE_PROXY_OFF_LABEL: "true"}
        nodes[node] = {KUBE_PROXY_OFF_LABEL: "true"}

    def step(t: int) -> None:
        with pytest.raises(NotYet):
            run(r.finalize(pxc, [], nodes, t, events))

    def agents() -> set[str]:
        return {
            o["spec"]["nodeName"] for (k, ns, _), o in api.objs.items() if k == "Pod" and ns == NS
        }

    def labels(node: str) -> dict[str, str]:
        return dict(api.objs[("Node", None, node)]["metadata"].get("labels") or {})

    step(0)  # n1's turn: kube-proxy comes back there, n2 keeps kube-proxy off
    assert KUBE_PROXY_OFF_LABEL not in labels("n1") and KUBE_PROXY_OFF_LABEL in labels("n2")
    assert agents() == {"n1", "n2"} and "KubeProxyMovedBack" in events.reasons()
    api.objs[("Pod", "kube-system", "kube-proxy-n1")] = kube_proxy_pod("n1", False)
    step(2)
    step(4)  # kube-proxy not Ready on n1: its agent keeps serving, its rules stay
    assert agents() == {"n1", "n2"} and "proxy.kpx.dev/cleanup" not in labels("n1")
    api.objs[("Pod", "kube-system", "kube-proxy-n1")] = kube_proxy_pod("n1", True)
    step(6)  # Ready: n1's agent stops
    assert agents() == {"n2"} and "proxy.kpx.dev/cleanup" not in labels("n1")
    step(8)  # gone: n1's rules go
    assert labels("n1")["proxy.kpx.dev/cleanup"] == "default"
    assert KUBE_PROXY_OFF_LABEL in labels("n2")  # still n2's agent's, one node at a time
