"""Pure: what the node agents report about their own Pods, for the status.

An agent that cannot apply spec.conntrack on its node records a Warning Event
`ConntrackNotApplied` about its Pod (and `ConntrackApplied` once a later attempt succeeds).
A node has a problem while the latest such Event of its *current* agent Pod says so: Events
of Pods that are gone (replaced by a rollout, deleted) no longer count.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
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


def agent_event_pod(event: Mapping[str, Any]) -> str | None:
    """The uid of the agent Pod an agent's Event is about; None for anyone else's Event."""
    if (event.get("source") or {}).get("component") != AGENT_EVENT_SOURCE:
        return None
    return str((event.get("involvedObject") or {}).get("uid") or "")


def latest_reports(
    events: Iterable[Mapping[str, Any]], live: Mapping[str, str], reasons: Collection[str]
) -> dict[str, Mapping[str, Any]]:
    """uid -> the latest agent Event with one of `reasons`, for each live agent Pod."""
    latest: dict[str, Mapping[str, Any]] = {}
    for event in events:
        uid = agent_event_pod(event)
        if uid is None or uid not in live or event.get("reason") not in reasons:
            continue
        if uid not in latest or _stamp(event) >= _stamp(latest[uid]):
            latest[uid] = event
    return latest


def conntrack_problems(
    pods: Iterable[Mapping[str, Any]], events: Iterable[Mapping[str, Any]]
) -> tuple[NodeProblem, ...]:
    """The nodes whose current agent Pod last reported ConntrackNotApplied, with its message."""
    live = live_agents(pods)
    latest = latest_reports(events, live, (CONNTRACK_NOT_APPLIED, CONNTRACK_APPLIED))
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
