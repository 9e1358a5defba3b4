"""Events about the agent's own Pod: how a node agent tells the operator what it could not do.

The agent's only write to the apiserver: a core/v1 Event in its Pod's namespace whose
involvedObject is its Pod (ServiceAccount kpx-agent may `create` events in that namespace and
nothing more; it can neither read nor change other Events). The operator reads them to
compute the ProxyConfiguration's status (see docs/operator.md, "Status").

The Pod is known from the downward API (POD_NAME, POD_NAMESPACE, POD_UID, set by the operator's
DaemonSet); without them (an agent started by hand) no event is sent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from kpx_api.constants import AGENT_EVENT_SOURCE, CONNTRACK_APPLIED, CONNTRACK_NOT_APPLIED
from kpx_kube import ApiError, Client

log = logging.getLogger(__name__)

#: events' source.component and reportingComponent (the operator selects on source).
COMPONENT: Final = AGENT_EVENT_SOURCE
__all__ = ["CONNTRACK_APPLIED", "CONNTRACK_NOT_APPLIED", "PodRef", "event_body", "post_event"]


@dataclass(frozen=True)
class PodRef:
    name: str
    namespace: str
    uid: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PodRef | None:
        env = os.environ if env is None else env
        name, ns, uid = (env.get(k, "") for k in ("POD_NAME", "POD_NAMESPACE", "POD_UID"))
        return cls(name, ns, uid) if name and ns and uid else None


def event_body(
    pod: PodRef, node: str, type_: str, reason: str, message: str, now: datetime
) -> dict[str, Any]:
    """A core/v1 Event about `pod` (pure)."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.name,
            "namespace": pod.namespace,
            "uid": pod.uid,
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post_event(client: Client, body: Mapping[str, Any]) -> bool:
    """POST the event; a refusal or an unreachable apiserver is logged, never raised."""
    namespace = body["metadata"]["namespace"]
    try:
        await client.create(f"/api/v1/namespaces/{namespace}/events", body)
    except ApiError as exc:  # a refusal, or Unreachable
        log.warning("event %s not recorded: %s", body["reason"], exc)
        return False
    return True
