"""The ProxyNodeState resource: what one node's agent has programmed, written by that agent.

Cluster-scoped, one per node, named after the node. The agent creates it and then writes its
status only when something in it changes, and at most once per `nodeStatePeriodSeconds`
(kpx_agent.observability.node_state). An admission policy shipped with the operator lets an
agent write only the object of its own node (the node its Pod's token is bound to). Its
ownerReference names the Node: when the Node is deleted, the garbage collector deletes its
ProxyNodeState.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import Field, ValidationError

from kpx_api.constants import API_VERSION
from kpx_api.errors import ConfigError
from kpx_api.modes import Mode
from kpx_api.validation import KpxModel, Text, Timestamp

NODE_STATE_KIND: Final = "ProxyNodeState"
NODE_STATE_LIST_KIND: Final = "ProxyNodeStateList"
NODE_STATE_PLURAL: Final = "proxynodestates"
NODE_STATE_SINGULAR: Final = "proxynodestate"
NODE_STATE_SHORT_NAMES: Final = ("pxns",)
NODE_STATE_CRD_NAME: Final = "proxynodestates.proxy.kpx.dev"
#: The request.userInfo.extra key a ServiceAccount token bound to a scheduled Pod carries:
#: the node the Pod runs on (the admission policy compares it with the object's name).
NODE_NAME_EXTRA: Final = "authentication.kubernetes.io/node-name"

Message = Annotated[str, Text(max_length=1024, message="")]


class AgentPodRef(KpxModel):
    """The agent Pod that wrote this state: the operator counts only its current agent's."""

    name: Annotated[str, Text(max_length=253, message="")] = Field(description="Pod name.")
    namespace: Annotated[str, Text(max_length=63, message="")] = Field(
        default="", description="Pod namespace."
    )
    uid: Annotated[str, Text(max_length=64, message="")] = Field(description="Pod uid.")


class LastSync(KpxModel):
    """The latest sync that programmed the kernel without error."""

    time: Timestamp = Field(description="When it ended (RFC 3339).")
    duration_seconds: float = Field(ge=0, description="How long it took, in seconds.")
    full: bool = Field(default=False, strict=True, description="A full sync (all rules).")


class Programmed(KpxModel):
    """What the agent has programmed on its node, as it counts it."""

    services: int = Field(default=0, ge=0, strict=True, description="Service ports programmed.")
    endpoints: int = Field(default=0, ge=0, strict=True, description="Endpoints programmed.")
    rules: int = Field(
        default=0,
        ge=0,
        strict=True,
        description="Kernel objects of the mode (nftables elements, iptables rules, IPVS "
        "virtual and real servers) the agent last programmed.",
    )


class LastError(KpxModel):
    """The latest error of a sync (the agent keeps the previous rules and retries)."""

    message: Message = Field(description="The kernel's (or backend's) error, shortened.")
    time: Timestamp = Field(description="When it happened (RFC 3339).")


class LeftoverKind(StrEnum):
    """Whose rules a leftover is."""

    KPX_MODE = "KpxMode"  # an agent of another kpx mode (a switch of mode)
    KUBE_PROXY = "KubeProxy"  # upstream kube-proxy (spec.takeover.fromKubeProxy)


class LeftoverState(StrEnum):
    """Where the removal of a leftover is."""

    PENDING = "Pending"  # not removed yet (before the first verified sync, or under way)
    WAITING = "Waiting"  # its precondition does not hold (kube-proxy's Pod is on the node)
    DRAINING = "Draining"  # its removal waits for its connections to end
    FAILING = "Failing"  # its removal failed; retried


class PendingLeftover(KpxModel):
    """Rules another proxy left on the node that the agent has not removed yet."""

    name: Annotated[str, Text(max_length=63, message="")] = Field(
        description="Whose rules: a kpx mode (nftables, iptables, ipvs) or kube-proxy."
    )
    kind: LeftoverKind | None = Field(
        default=None,
        description="KpxMode (another kpx mode's rules) or KubeProxy (upstream kube-proxy's).",
    )
    state: LeftoverState = Field(
        default=LeftoverState.PENDING,
        description="Pending (not removed yet), Waiting (its precondition does not hold: "
        "kube-proxy's Pod still runs on the node), Draining (waiting for its connections to "
        "end) or Failing (the removal failed; retried).",
    )
    message: Message = Field(
        default="", description="Why they are still there (the removal's error, or a wait)."
    )


class ModeVerdict(KpxModel):
    """Whether the node can run one kpx mode, as its agent checked at start."""

    mode: Mode = Field(description="The mode checked (nftables, iptables, ipvs).")
    ok: bool = Field(strict=True, description="The node can run it.")
    detail: Annotated[str, Text(max_length=280, message="")] = Field(
        default="", description="What was found (versions), or why the node cannot run it."
    )


class ProxyNodeStateStatus(KpxModel):
    """Written by the node's agent."""

    mode: Mode | None = Field(default=None, description="The mode the agent programs.")
    agent_version: Annotated[str, Text(max_length=64, message="")] = Field(
        default="", description="The agent's version."
    )
    agent_pod: AgentPodRef | None = Field(default=None, description="The agent Pod.")
    configuration_generation: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="metadata.generation of the ProxyConfiguration whose settings the agent "
        "has synced (absent until its first successful sync, or when the agent runs from a "
        "file without one).",
    )
    first_sync_verified: bool = Field(
        default=False,
        strict=True,
        description="The agent's first full sync is programmed and found in the kernel.",
    )
    rolled_back: Message = Field(
        default="",
        description="During a switch of mode: why this agent went back to the old mode "
        "(empty: it did not).",
    )
    last_sync: LastSync | None = Field(default=None, description="The latest successful sync.")
    programmed: Programmed | None = Field(default=None, description="What is programmed.")
    last_error: LastError | None = Field(
        default=None,
        description="The latest sync error, kept after later successful syncs (a lastSync.time "
        "after its time: the node recovered).",
    )
    conntrack_not_applied: Message = Field(
        default="",
        description="What of spec.conntrack the agent could not set on its node (empty: all "
        "of it is applied).",
    )
    leftovers_pending: Annotated[list[PendingLeftover], Field(max_length=8)] = Field(
        default_factory=list,
        description="Other proxies' rules still on the node, removed after the agent's first "
        "verified sync.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    takeover_from_kube_proxy: bool = Field(
        default=False,
        strict=True,
        description="The agent takes the node over from upstream kube-proxy "
        "(spec.takeover.fromKubeProxy): kube-proxy's rules are among the leftovers it removes "
        "(once they are not in leftoversPending, they are removed).",
    )
    preflight: Annotated[list[ModeVerdict], Field(max_length=4)] = Field(
        default_factory=list,
        description="Which kpx modes the node can run, one verdict per mode, as its agent "
        "checked at start (empty until it has): what condition Preflight of the "
        "ProxyConfiguration is made of.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mode"]},
    )


class ProxyNodeState(KpxModel):
    """What one node's kpx agent has programmed: mode, configuration generation, agent
    version, last sync and last error. Cluster-scoped, named after the node, written only by
    that node's agent."""

    api_version: Literal["proxy.kpx.dev/v1alpha1"] = Field(
        default=API_VERSION, description="proxy.kpx.dev/v1alpha1"
    )
    kind: Literal["ProxyNodeState"] = Field(default=NODE_STATE_KIND, description=NODE_STATE_KIND)
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    status: ProxyNodeStateStatus | None = Field(default=None, description="Observed state.")


def parse_node_state_status(data: Mapping[str, Any] | None) -> ProxyNodeStateStatus | None:
    """A ProxyNodeState's status as written; None when absent. `ConfigError` names each bad
    field."""
    if not data:
        return None
    try:
        return ProxyNodeStateStatus.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, "status") from None
