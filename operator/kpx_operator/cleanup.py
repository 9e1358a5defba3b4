"""Pure: deleting a ProxyConfiguration with spec.deletionPolicy Cleanup, node by node.

Each node the agents ran on goes through these steps, at most `window` nodes at a time
(spec.maxUnavailable), so a deletion never removes every node's rules at once:

1. its turn begins: the node gets DELETING_LABEL (value: the configuration's instance label);
2. with spec.takeover.moveKubeProxyOff: KUBE_PROXY_OFF_LABEL is removed, so kube-proxy's
   DaemonSet comes back to the node, and the node waits until kube-proxy's Pod there is Ready;
3. its agent Pod is deleted (the agent stops and leaves its rules: both proxies served until
   now) and the node waits until that Pod is gone, so no agent rewrites rules after step 4;
4. the node gets CLEANUP_LABEL, which the cleanup DaemonSet selects: its Pod removes the mode's
   rules and turns Ready; the node is clean.

Everything is read back from the cluster on each pass (Pods, node labels), so an operator
restarted half-way goes on where it was. `plan` decides one pass; the reconciler applies it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kpx_api.takeover import KUBE_PROXY_OFF_LABEL

#: On a node whose cleanup began (value: the configuration's app.kubernetes.io/instance).
DELETING_LABEL: Final = "proxy.kpx.dev/deleting"
#: On a node whose agent is gone, for the cleanup DaemonSet to run there (same value).
CLEANUP_LABEL: Final = "proxy.kpx.dev/cleanup"

Obj = dict[str, Any]


@dataclass(frozen=True)
class NodeState:
    """What a pass knows of one node of the configuration being deleted."""

    agent: bool = False  # a live agent Pod is on it
    agent_stopping: bool = False  # an agent Pod there is terminating
    deleting: bool = False  # DELETING_LABEL is ours
    cleaning: bool = False  # CLEANUP_LABEL is ours
    clean: bool = False  # a cleanup Pod there is Ready
    kube_proxy_off: bool = False  # KUBE_PROXY_OFF_LABEL is on it
    kube_proxy_ready: bool = False  # a Ready kube-proxy Pod runs there


@dataclass(frozen=True)
class Plan:
    """What one pass does, and where the deletion stands."""

    begin: tuple[str, ...] = ()  # label DELETING_LABEL
    move_back: tuple[str, ...] = ()  # remove KUBE_PROXY_OFF_LABEL
    stop_agent: tuple[str, ...] = ()  # delete the agent Pod
    clean: tuple[str, ...] = ()  # label CLEANUP_LABEL
    #: node -> what it waits for (the nodes in their turn, not clean yet).
    waiting: dict[str, str] = field(default_factory=dict)
    done: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()  # not begun (their agents keep serving)

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.pending and not self.clean and not self.stop_agent

    @property
    def total(self) -> int:
        return len(self.done) + len(self.waiting) + len(self.pending)


def plan(nodes: Mapping[str, NodeState], window: int, *, wait_for_kube_proxy: bool) -> Plan:
    """One pass over `nodes` (every node of the configuration). `wait_for_kube_proxy`:
    spec.takeover.moveKubeProxyOff and kube-proxy's DaemonSet exists."""
    done = sorted(n for n, s in nodes.items() if s.clean)
    started = sorted(n for n, s in nodes.items() if not s.clean and (s.deleting or s.cleaning))
    pending = sorted(
        n for n, s in nodes.items() if not s.clean and not s.deleting and not s.cleaning
    )
    begin = pending[: max(0, window - len(started))]
    move_back, stop, clean = [], [], []
    waiting: dict[str, str] = {}
    for name in sorted(started + begin):
        s = nodes[name]
        if s.cleaning:
            waiting[name] = "its cleanup Pod is not Ready yet"
        elif wait_for_kube_proxy and s.kube_proxy_off:
            move_back.append(name)
            waiting[name] = "kube-proxy is coming back"
        elif wait_for_kube_proxy and not s.kube_proxy_ready:
            waiting[name] = "kube-proxy's Pod there is not Ready yet"
        elif s.agent:
            stop.append(name)
            waiting[name] = "its agent is stopping"
        elif s.agent_stopping:
            waiting[name] = "its agent is stopping"
        else:
            clean.append(name)
            waiting[name] = "its cleanup Pod is not Ready yet"
    return Plan(
        begin=tuple(begin),
        move_back=tuple(move_back),
        stop_agent=tuple(stop),
        clean=tuple(clean),
        waiting=waiting,
        done=tuple(done),
        pending=tuple(pending[len(begin) :]),
    )


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _node_of(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """Ready, and not on its way out."""
    if _terminating(pod):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def node_states(
    instance: str,
    agent_pods: Iterable[Mapping[str, Any]],
    cleanup_pods: Iterable[Mapping[str, Any]],
    marked_nodes: Iterable[Mapping[str, Any]],
    kube_proxy_pods: Iterable[Mapping[str, Any]],
    node_labels: Mapping[str, Mapping[str, str]],
) -> dict[str, NodeState]:
    """Every node of the configuration: those with an agent Pod, and those carrying
    DELETING_LABEL or CLEANUP_LABEL of `instance` (`marked_nodes`: Node objects, read just
    now; `node_labels`: every node's labels, as last seen)."""
    agents = [p for p in agent_pods if _node_of(p)]
    live = {_node_of(p) for p in agents if not _terminating(p)}
    stopping = {_node_of(p) for p in agents if _terminating(p)}
    clean = {_node_of(p) for p in cleanup_pods if pod_ready(p)}
    kube_proxy = {_node_of(p) for p in kube_proxy_pods if pod_ready(p)}
    marked = {
        str((n.get("metadata") or {}).get("name")): _labels(n)
        for n in marked_nodes
        if instance in (_labels(n).get(DELETING_LABEL), _labels(n).get(CLEANUP_LABEL))
    }
    out = {}
    for name in sorted(live | stopping | set(marked)):
        labels = marked.get(name, node_labels.get(name) or {})
        cleaning = labels.get(CLEANUP_LABEL) == instance
        out[name] = NodeState(
            agent=name in live,
            agent_stopping=name in stopping,
            deleting=labels.get(DELETING_LABEL) == instance,
            cleaning=cleaning,
            clean=cleaning and name in clean,
            kube_proxy_off=KUBE_PROXY_OFF_LABEL in labels,
            kube_proxy_ready=name in kube_proxy,
        )
    return out


def marks_patch(deleting: str | None = None, cleanup: str | None = None) -> Obj:
    """The merge patch of a node's deletion labels (None removes one)."""
    return {"metadata": {"labels": {DELETING_LABEL: deleting, CLEANUP_LABEL: cleanup}}}


def waiting_summary(p: Plan) -> str:
    """``2 of 5 nodes clean; n3: kube-proxy's Pod there is not Ready yet; ...``."""
    head = f"{len(p.done)} of {p.total} nodes clean"
    said = [f"{n}: {why}" for n, why in sorted(p.waiting.items())[:5]]
    return "; ".join([head, *said])
