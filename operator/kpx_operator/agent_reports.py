"""Pure: what the node agents report about their own Pods, for the status.

An agent that cannot apply spec.conntrack on its node records a Warning Event
`ConntrackNotApplied` about its Pod (and `ConntrackApplied` once a later attempt succeeds).
A node has a problem while the latest such Event of its *current* agent Pod says so: Events
of Pods that are gone (replaced by a rollout, deleted) no longer count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kpx_api.constants import AGENT_EVENT_SOURCE, CONNTRACK_APPLIED, CONNTRACK_NOT_APPLIED

from .admission import node_list


@dataclass(frozen=True, order=True)
class NodeProblem:
    node: str
    message: str


def _stamp(event: Mapping[str, Any]) -> tuple[str, int]:
    meta = event.get("metadata") or {}
    when = event.get("lastTimestamp") or event.get("eventTime") or meta.get("creationTimestamp")
    version = str(meta.get("resourceVersion") or "0")
    return (str(when or ""), int(version) if version.isdigit() else 0)


def conntrack_problems(
    pods: Iterable[Mapping[str, Any]], events: Iterable[Mapping[str, Any]]
) -> tuple[NodeProblem, ...]:
    """The nodes whose current agent Pod last reported ConntrackNotApplied, with its message."""
    live: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not meta.get("deletionTimestamp") and meta.get("uid"):
            live[str(meta["uid"])] = str((pod.get("spec") or {}).get("nodeName") or "")
    latest: dict[str, Mapping[str, Any]] = {}
    for event in events:
        if (event.get("source") or {}).get("component") != AGENT_EVENT_SOURCE:
            continue
        if event.get("reason") not in (CONNTRACK_NOT_APPLIED, CONNTRACK_APPLIED):
            continue
        uid = str((event.get("involvedObject") or {}).get("uid") or "")
        if uid in live and (uid not in latest or _stamp(event) >= _stamp(latest[uid])):
            latest[uid] = event
    return tuple(
        sorted(
            NodeProblem(live[uid] or uid, str(event.get("message") or ""))
            for uid, event in latest.items()
            if event.get("reason") == CONNTRACK_NOT_APPLIED
        )
    )


def conntrack_message(problems: tuple[NodeProblem, ...]) -> str:
    """For the Degraded condition: which nodes, and what the first one said."""
    nodes = node_list(p.node for p in problems)
    where = f"node {nodes}" if len(problems) == 1 else f"nodes {nodes}"
    return f"spec.conntrack is not applied on {where}: {problems[0].message}"
