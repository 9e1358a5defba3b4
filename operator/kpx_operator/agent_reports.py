"""Pure: what the node agents report, for the status.

Each agent writes its node's ProxyNodeState (kpx_api.nodestate); only the state written by
the node's *current* agent Pod counts (status.agentPod.uid): a state left by a Pod that is
gone (replaced by a rollout, deleted) does not. An agent that cannot apply spec.conntrack on
its node says what in status.conntrackNotApplied (and records a Warning Event
`ConntrackNotApplied` about its Pod, for people). Preflight (preflight.py), the takeover from
kube-proxy (takeover.py) and the switch of mode (mode_switch.py) read the same states; the
operator reads no Event of the agents.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kpx_api.errors import ConfigError
from kpx_api.nodestate import ProxyNodeStateStatus, parse_node_state_status

from .admission import node_list


@dataclass(frozen=True, order=True)
class NodeProblem:
    node: str
    message: str


def live_agents(pods: Iterable[Mapping[str, Any]], scheduled_only: bool = False) -> dict[str, str]:
    """uid -> node name ("" while unscheduled, or left out with `scheduled_only`) of the agent
    Pods that are not being deleted: only their reports count."""
    live: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        if (node or not scheduled_only) and not meta.get("deletionTimestamp") and meta.get("uid"):
            live[str(meta["uid"])] = node
    return live


def node_states(
    objects: Iterable[Mapping[str, Any]], live: Mapping[str, str]
) -> dict[str, ProxyNodeStateStatus]:
    """agent Pod uid -> the status of its node's ProxyNodeState, for each live agent Pod that
    wrote the ProxyNodeState of its own node (a state written by a Pod that is gone, or that
    does not parse, does not count)."""
    out: dict[str, ProxyNodeStateStatus] = {}
    for obj in objects:
        name = str((obj.get("metadata") or {}).get("name") or "")
        try:
            status = parse_node_state_status(obj.get("status"))
        except ConfigError:
            continue
        if status is None or status.agent_pod is None:
            continue
        uid = status.agent_pod.uid
        if live.get(uid) == name:
            out[uid] = status
    return out


def conntrack_problems(
    pods: Iterable[Mapping[str, Any]], states: Iterable[Mapping[str, Any]]
) -> tuple[NodeProblem, ...]:
    """The nodes whose current agent Pod says in its ProxyNodeState that spec.conntrack is
    not applied, with what."""
    live = live_agents(pods, scheduled_only=True)
    return tuple(
        sorted(
            NodeProblem(live[uid], f"conntrack settings not applied: {s.conntrack_not_applied}")
            for uid, s in node_states(states, live).items()
            if s.conntrack_not_applied
        )
    )


def conntrack_message(problems: tuple[NodeProblem, ...]) -> str:
    """For the Degraded condition: which nodes, and what the first one said."""
    nodes = node_list(p.node for p in problems)
    where = f"node {nodes}" if len(problems) == 1 else f"nodes {nodes}"
    return f"spec.conntrack is not applied on {where}: {problems[0].message}"
