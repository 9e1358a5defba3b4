"""Pure: may a ProxyConfiguration deploy its agents? (a backend for its mode, ipvs policy,
node conflicts)

A configuration whose mode has no backend in the agent (kpx_api.MODES_WITH_BACKEND) deploys
nothing: its agents would only exit at start, over and over.

Two ProxyConfigurations whose node selectors select the same node would run two agents on it,
programming the same kernel. That is a conflict: both report it (Degraded, naming the nodes),
and of each conflicting pair the older one (creationTimestamp, then name) keeps the contested
nodes while the newer one keeps them out of its agents (`Admission.kept_out`): its agents on
its other nodes keep running. A conflict never removes running agents elsewhere (issue #22: a
relabelled or new node must not cost a configuration its agents everywhere). The rule is
pairwise, so the outcome never depends on which other objects happen to be in conflict: a
configuration runs on the nodes it shares with no older one. Configurations that the ipvs
policy denies, or whose mode has no backend, deploy nothing and so conflict with nobody.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from kpx_api import MODES_WITH_BACKEND, Mode

from .names import LABEL_INSTANCE

#: Node lists in messages are cut after this many names.
MAX_LISTED_NODES: Final = 10


class IPVSPolicy(StrEnum):
    """What the operator does with mode ipvs (deprecated upstream)."""

    ALLOW = "allow"  # deploy; the Deprecated condition still says so
    WARN = "warn"  # deploy, and post a Warning event pointing to nftables
    DENY = "deny"  # deploy nothing; Degraded (IPVSDenied)


@dataclass(frozen=True)
class PxcInfo:
    """What admission needs to know of one ProxyConfiguration."""

    name: str
    uid: str
    created: str  # metadata.creationTimestamp, RFC 3339 (sorts as text)
    mode: str
    node_selector: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PxcInfo:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        selector = spec.get("nodeSelector") or {}
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            created=str(meta.get("creationTimestamp", "")),
            mode=str(spec.get("mode", "")),
            node_selector=tuple(sorted((str(k), str(v)) for k, v in selector.items())),
        )

    @property
    def age_key(self) -> tuple[str, str]:
        """Sorts older first: creationTimestamp, then name."""
        return (self.created, self.name)

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.node_selector)


@dataclass(frozen=True)
class Overlap:
    """Nodes selected by this configuration and by `other` as well."""

    other: str
    nodes: tuple[str, ...]
    other_is_older: bool
    #: `other` was deleted with deletionPolicy Orphan: its agents still run on `nodes`.
    orphaned: bool = False


@dataclass(frozen=True)
class Admission:
    """The verdict for one ProxyConfiguration."""

    deploy: bool
    deprecated: bool = False  # mode ipvs
    ipvs_denied: bool = False
    no_backend: bool = False  # the agent has no backend for the mode (ModeNotImplemented)
    overlaps: tuple[Overlap, ...] = ()

    @property
    def blocked_by(self) -> tuple[Overlap, ...]:
        """The overlaps with older configurations: their nodes are kept out of this one."""
        return tuple(o for o in self.overlaps if o.other_is_older)

    @property
    def kept_out(self) -> tuple[str, ...]:
        """The nodes this configuration's agents stay off (an older one selects them too)."""
        return tuple(sorted({n for o in self.blocked_by for n in o.nodes}))


def denied(mode: str, policy: IPVSPolicy) -> bool:
    return mode == Mode.IPVS and policy is IPVSPolicy.DENY


def admit(
    me: PxcInfo,
    others: Iterable[PxcInfo],
    nodes: Mapping[str, Mapping[str, str]],
    policy: IPVSPolicy,
    backends: Collection[str] = MODES_WITH_BACKEND,
    orphaned: Mapping[str, Collection[str]] | None = None,
) -> Admission:
    """Whether `me` may deploy, given every ProxyConfiguration (`others` may include `me`),
    the nodes (name -> labels), the ipvs policy, the modes the agent has a backend for, and
    the nodes where agents of deleted configurations still run (`orphaned_agents`): those
    are kept out as if an older configuration selected them."""
    deprecated = me.mode == Mode.IPVS
    if denied(me.mode, policy):
        return Admission(deploy=False, deprecated=deprecated, ipvs_denied=True)
    if me.mode not in backends:
        return Admission(deploy=False, deprecated=deprecated, no_backend=True)
    mine = {name for name, node_labels in nodes.items() if me.selects(node_labels)}
    overlaps = []
    for other in sorted(others, key=lambda o: o.age_key):
        if other.uid == me.uid or other.name == me.name or denied(other.mode, policy):
            continue
        if other.mode not in backends:
            continue
        shared = sorted(n for n in mine if other.selects(nodes[n]))
        if shared:
            overlaps.append(Overlap(other.name, tuple(shared), other.age_key < me.age_key))
    for other_name, held in sorted((orphaned or {}).items()):
        shared = sorted(n for n in mine if n in held)
        if shared:
            overlaps.append(Overlap(other_name, tuple(shared), True, orphaned=True))
    return Admission(deploy=True, deprecated=deprecated, overlaps=tuple(overlaps))


def orphaned_agents(
    pods: Iterable[Mapping[str, Any]], configurations: Collection[str]
) -> dict[str, tuple[str, ...]]:
    """instance -> the nodes its agent Pods run on, for the agent Pods (label
    app.kubernetes.io/name=kpx-agent) whose app.kubernetes.io/instance is no ProxyConfiguration
    of `configurations` (instance label values): what deletionPolicy Orphan left running."""
    out: dict[str, set[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        inst = str((meta.get("labels") or {}).get(LABEL_INSTANCE) or "")
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        if inst and node and inst not in configurations and not meta.get("deletionTimestamp"):
            out.setdefault(inst, set()).add(node)
    return {inst: tuple(sorted(held)) for inst, held in sorted(out.items())}


def node_list(nodes: Iterable[str]) -> str:
    """``a, b, c`` or ``a, b, ... and 5 more``."""
    names = list(nodes)
    if len(names) <= MAX_LISTED_NODES:
        return ", ".join(names)
    rest = len(names) - MAX_LISTED_NODES
    return ", ".join(names[:MAX_LISTED_NODES]) + f" and {rest} more"


def conflict_message(admission: Admission) -> str:
    """For the Degraded condition and the events: who overlaps on which nodes, who runs."""
    parts = []
    for o in admission.overlaps:
        nodes = f"node {o.nodes[0]} is" if len(o.nodes) == 1 else f"nodes {node_list(o.nodes)} are"
        if o.orphaned:
            parts.append(
                f"{nodes} still served by the agents of ProxyConfiguration {o.other}, "
                "deleted with deletionPolicy Orphan (delete its DaemonSet to free "
                "them)"
            )
            continue
        who = "older, runs there" if o.other_is_older else "newer, stays off them"
        parts.append(f"{nodes} also selected by ProxyConfiguration {o.other} ({who})")
    out = admission.kept_out
    verdict = (
        f"this one keeps its agents off {'node' if len(out) == 1 else 'nodes'} "
        f"{node_list(out)} until the node selectors are disjoint (its other nodes keep theirs)"
        if out
        else "this one keeps its agents"
    )
    return "; ".join(parts) + f": {verdict}"
