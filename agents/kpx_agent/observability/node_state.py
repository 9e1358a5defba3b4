"""Pure: this node's ProxyNodeState (kpx_api.nodestate), and when to write it.

* `NodeFacts`: what the agent knows of its own dataplane at one moment.
* `status_of`: the status those facts make (the JSON the apiserver stores).
* `WriteGate`: whether a status is written now, later, or not at all: only when it differs
  from the one last written in something other than the last sync's time and duration (a
  sync that changes nothing else is not news), and at most once per `interval` seconds; a
  change within the interval waits for its end, and then the newest status is written (the
  changes in between coalesce into one write).
* `node_state_object`: the object the agent creates for its node, owned by the Node (the
  garbage collector deletes it with the Node).

The I/O (create, status patches, retries) is in node_state_writer.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from kpx_api.constants import API_VERSION
from kpx_api.nodestate import NODE_STATE_KIND, PendingLeftover
from kpx_api.preflight import ModeCheck

#: Seconds between two writes of one node's ProxyNodeState at most (the default of
#: `--node-state-period`): with 1,000 nodes, at most 100 writes/s whatever the churn.
DEFAULT_WRITE_INTERVAL: Final = 10.0
#: Fields of the status left out of the change check (they change with every sync).
VOLATILE: Final = ("time", "durationSeconds")
_MAX_MESSAGE: Final = 1024
#: The CRD's bounds: leftoversPending, preflight, preflight[].detail.
MAX_LEFTOVERS: Final = 8
MAX_VERDICTS: Final = 4
MAX_DETAIL: Final = 280


@dataclass(frozen=True)
class SyncRecord:
    """The latest successful sync."""

    ended: datetime
    duration: float
    full: bool


@dataclass(frozen=True)
class ErrorRecord:
    message: str
    at: datetime


@dataclass(frozen=True)
class NodeFacts:
    """What the agent knows of its node's dataplane."""

    mode: str
    agent_version: str
    pod: tuple[str, str, str] | None = None  # name, namespace, uid of the agent Pod
    generation: int | None = None
    verified: bool = False
    rolled_back: str = ""
    last_sync: SyncRecord | None = None
    services: int = 0
    endpoints: int = 0
    rules: int = 0
    last_error: ErrorRecord | None = None
    conntrack_not_applied: str = ""
    #: the leftovers not removed yet: whose, where their removal is, why still there
    leftovers: Sequence[PendingLeftover] = field(default_factory=tuple)
    #: kube-proxy's rules are among the leftovers the agent removes (spec.takeover)
    takeover_from_kube_proxy: bool = False
    #: which kpx modes the node can run (empty until checked)
    preflight: Sequence[ModeCheck] = field(default_factory=tuple)


def _stamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _brief(text: str, limit: int = _MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def status_of(facts: NodeFacts) -> dict[str, Any]:
    """The ProxyNodeState status of `facts` (camelCase JSON, as ProxyNodeStateStatus)."""
    status: dict[str, Any] = {
        "mode": facts.mode,
        "agentVersion": facts.agent_version,
        "firstSyncVerified": facts.verified,
        "rolledBack": _brief(facts.rolled_back),
        "programmed": {
            "services": facts.services,
            "endpoints": facts.endpoints,
            "rules": facts.rules,
        },
        "conntrackNotApplied": _brief(facts.conntrack_not_applied),
        "leftoversPending": [
            {
                "name": p.name,
                "kind": p.kind.value if p.kind else None,
                "state": p.state.value,
                "message": _brief(p.message),
            }
            for p in facts.leftovers[:MAX_LEFTOVERS]
        ],
        "takeoverFromKubeProxy": facts.takeover_from_kube_proxy,
        "preflight": [
            {"mode": c.mode, "ok": c.ok, "detail": _brief(c.detail, MAX_DETAIL)}
            for c in facts.preflight[:MAX_VERDICTS]
        ],
        # Absent fields are sent as null: a merge patch then removes what no longer holds.
        "configurationGeneration": facts.generation,
        "lastSync": None,
        "lastError": None,
        "agentPod": None,
    }
    if facts.pod is not None:
        name, namespace, uid = facts.pod
        status["agentPod"] = {"name": name, "namespace": namespace, "uid": uid}
    if facts.last_sync is not None:
        status["lastSync"] = {
            "time": _stamp(facts.last_sync.ended),
            "durationSeconds": round(facts.last_sync.duration, 3),
            "full": facts.last_sync.full,
        }
    if facts.last_error is not None:
        status["lastError"] = {
            "message": _brief(facts.last_error.message),
            "time": _stamp(facts.last_error.at),
        }
    return status


def significant(status: Mapping[str, Any]) -> dict[str, Any]:
    """`status` without what changes with every sync (the last sync's time and duration)."""
    out = dict(status)
    last = out.get("lastSync")
    if isinstance(last, Mapping):
        out["lastSync"] = {k: v for k, v in last.items() if k not in VOLATILE}
    return out


class WriteGate:
    """When one node's status is written: on change only, at most once per `interval`."""

    def __init__(self, interval: float = DEFAULT_WRITE_INTERVAL) -> None:
        if not interval > 0:
            raise ValueError(f"node state write interval: {interval}: must be above 0 seconds")
        self.interval = interval
        self._written: dict[str, Any] | None = None
        self._at: float | None = None

    def wait(self, status: Mapping[str, Any], now: float) -> float | None:
        """Seconds until `status` may be written (0: now); None: nothing to write (it says
        what the last write said)."""
        if self._written is not None and significant(status) == self._written:
            return None
        if self._at is None:
            return 0.0
        return max(0.0, self._at + self.interval - now)

    def wrote(self, status: Mapping[str, Any], now: float) -> None:
        """`status` was written at `now`."""
        self._written = significant(status)
        self._at = now

    def forget(self) -> None:
        """The object is gone (deleted by someone): the next status is written at once."""
        self._written = None


def node_state_object(node: str, node_uid: str | None) -> dict[str, Any]:
    """The ProxyNodeState the agent creates for `node` (no status: that goes through the
    status subresource). With the Node's uid, the Node owns it: deleting the Node deletes it."""
    meta: dict[str, Any] = {"name": node, "labels": {"app.kubernetes.io/part-of": "kpx"}}
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}
        ]
    return {"apiVersion": API_VERSION, "kind": NODE_STATE_KIND, "metadata": meta}
