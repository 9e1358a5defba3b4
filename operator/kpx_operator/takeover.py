"""Pure: taking the nodes over from upstream kube-proxy (spec.takeover), the operator's part.

* `node_phases`: each node's phase, from its node's ProxyNodeState as its *current* agent Pod
  wrote it (status.agentPod.uid: a state written by a Pod that is gone does not count):
  firstSyncVerified (the agent serves the node), and the entry of kind KubeProxy in
  leftoversPending: state Waiting (kube-proxy's Pod is still there), Failing (the removal
  fails, retried); none while takeoverFromKubeProxy holds: kube-proxy's rules are removed.
* With spec.takeover.moveKubeProxyOff: `nodes_to_label` (the nodes whose agent serves them and
  that do not carry KUBE_PROXY_OFF_LABEL yet) and `affinity_patch`, the merge patch that adds
  "KUBE_PROXY_OFF_LABEL DoesNotExist" to the kube-proxy DaemonSet's required node affinity
  (to every nodeSelectorTerm: terms are ORed, so a term without it would still admit a
  labelled node), or None when the DaemonSet already has it.
* `takeover_status`: status.takeover (per-node phase and a summary).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kpx_api.nodestate import LeftoverKind, LeftoverState, ProxyNodeStateStatus
from kpx_api.takeover import KUBE_PROXY_OFF_LABEL, TakeoverNode, TakeoverPhase, TakeoverStatus

from .agent_reports import live_agents, node_states

Phase = TakeoverPhase
KUBE_PROXY_NAMESPACE: Final = "kube-system"
#: status.takeover.nodes holds at most this many (the CRD's maxItems).
MAX_LISTED: Final = 5000
KUBE_PROXY_DAEMONSET: Final = "kube-proxy"
#: How far along each phase is (the status lists the nodes furthest behind first).
_RANK: Final = {
    Phase.AGENT_NOT_READY: 0,
    Phase.AGENT_READY: 1,
    Phase.WAITING_FOR_KUBE_PROXY: 2,
    Phase.REMOVAL_FAILING: 3,
    Phase.KUBE_PROXY_RULES_REMOVED: 4,
}
#: The phases in which kpx serves the node (kube-proxy may leave it).
SERVING: Final = frozenset(
    {
        Phase.AGENT_READY,
        Phase.WAITING_FOR_KUBE_PROXY,
        Phase.REMOVAL_FAILING,
        Phase.KUBE_PROXY_RULES_REMOVED,
    }
)


def phase_of(state: ProxyNodeStateStatus | None) -> tuple[Phase, str]:
    """A node's phase (and why) from its agent's ProxyNodeState status (None: none yet)."""
    if state is None or not state.first_sync_verified:
        return Phase.AGENT_NOT_READY, ""
    for leftover in state.leftovers_pending:
        if leftover.kind is not LeftoverKind.KUBE_PROXY:
            continue
        if leftover.state is LeftoverState.WAITING:
            return Phase.WAITING_FOR_KUBE_PROXY, leftover.message
        if leftover.state is LeftoverState.FAILING:
            return Phase.REMOVAL_FAILING, leftover.message
        return Phase.AGENT_READY, leftover.message
    if state.takeover_from_kube_proxy:
        return Phase.KUBE_PROXY_RULES_REMOVED, "removed upstream kube-proxy's rules"
    # An agent of a configuration before spec.takeover: it serves, kube-proxy's rules are not
    # its business (its replacement's are).
    return Phase.AGENT_READY, "its agent does not take over from kube-proxy"


def node_phases(
    pods: Iterable[Mapping[str, Any]], states: Iterable[Mapping[str, Any]]
) -> dict[str, tuple[Phase, str]]:
    """node -> (phase, why) for every node with a live agent Pod; `states`: the
    ProxyNodeState objects."""
    live = live_agents(pods, scheduled_only=True)
    reported = node_states(states, live)
    return {node: phase_of(reported.get(uid)) for uid, node in live.items()}


def nodes_to_label(
    phases: Mapping[str, tuple[Phase, str]], labels: Mapping[str, Mapping[str, str]]
) -> list[str]:
    """The nodes kpx serves that kube-proxy has not been told to leave yet."""
    return sorted(
        node
        for node, (phase, _) in phases.items()
        if phase in SERVING and node in labels and KUBE_PROXY_OFF_LABEL not in labels[node]
    )


def node_label_patch(node_name: str, on: bool) -> dict[str, Any]:
    """Merge patch of a Node: set (or remove) KUBE_PROXY_OFF_LABEL."""
    del node_name
    return {"metadata": {"labels": {KUBE_PROXY_OFF_LABEL: "true" if on else None}}}


_EXCLUDE: Final = {"key": KUBE_PROXY_OFF_LABEL, "operator": "DoesNotExist"}


def affinity_patch(daemonset: Mapping[str, Any]) -> dict[str, Any] | None:
    """Merge patch of the kube-proxy DaemonSet excluding labelled nodes, or None when every
    term of its required node affinity already excludes them. The patch carries the
    DaemonSet's resourceVersion: a concurrent change makes it fail (Conflict) and it is
    computed again from the new object."""
    spec = ((daemonset.get("spec") or {}).get("template") or {}).get("spec") or {}
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = copy.deepcopy(list(required.get("nodeSelectorTerms") or []))
    if not terms:
        terms = [{}]
    changed = False
    for term in terms:
        expressions = list(term.get("matchExpressions") or [])
        if _EXCLUDE not in expressions:
            term["matchExpressions"] = [*expressions, dict(_EXCLUDE)]
            changed = True
    if not changed:
        return None
    version = (daemonset.get("metadata") or {}).get("resourceVersion")
    return {
        "metadata": {"resourceVersion": version} if version else {},
        "spec": {
            "template": {
                "spec": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": terms
                            }
                        }
                    }
                }
            }
        },
    }


def takeover_status(
    phases: Mapping[str, tuple[Phase, str]], labels: Mapping[str, Mapping[str, str]]
) -> TakeoverStatus:
    nodes = [
        TakeoverNode(
            name=node,
            phase=phase,
            message=message[:1024],
            kube_proxy_off=KUBE_PROXY_OFF_LABEL in (labels.get(node) or {}),
        )
        for node, (phase, message) in sorted(phases.items())
    ]
    # The status lists at most MAX_LISTED nodes (the furthest behind first); the counts and the
    # summary cover every node.
    listed = sorted(nodes, key=lambda n: (_RANK[n.phase], n.name))[:MAX_LISTED]
    counts: dict[Phase, int] = {}
    for n in nodes:
        counts[n.phase] = counts.get(n.phase, 0) + 1
    done = counts.get(Phase.KUBE_PROXY_RULES_REMOVED, 0)
    parts = [f"{counts[p]} {p.value}" for p in sorted(counts, key=_RANK.__getitem__)]
    summary = f"{done} of {len(nodes)} nodes taken over from kube-proxy"
    if parts:
        summary += f" ({', '.join(parts)})"
    return TakeoverStatus(nodes=sorted(listed, key=lambda n: n.name), done=done, summary=summary)
