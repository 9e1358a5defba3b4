"""The ProxyConfiguration resource: spec (proxy settings + agent placement) and status."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import Field, ValidationError

from kpx_api.constants import API_VERSION, KIND
from kpx_api.errors import ConfigError
from kpx_api.modes import Mode
from kpx_api.names import DNSSubdomain
from kpx_api.preflight import DroppedSetting
from kpx_api.proxysettings import ProxySettings
from kpx_api.scheduling import (
    IntOrPercent,
    ResourceRequirements,
    Toleration,
    default_agent_resources,
)
from kpx_api.selectors import LabelMap
from kpx_api.takeover import TakeoverStatus
from kpx_api.validation import KpxModel, SetList, Text, Timestamp

DEFAULT_PRIORITY_CLASS: Final = "system-node-critical"
#: spec.modeSwitch.progressDeadlineSeconds by default.
DEFAULT_PROGRESS_DEADLINE: Final = 30

IMAGE_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"
Image = Annotated[
    str,
    Text(
        max_length=512,
        min_length=1,
        pattern=IMAGE_PATTERN,
        message="must be a container image reference such as ghcr.io/kpx/kpx-agent:0.1.0",
    ),
]


class ModeSwitch(KpxModel):
    """A change of spec.mode: what the user accepts to lose, and what happens to a node that
    cannot run the new mode."""

    accept_dropped: Annotated[list[DroppedSetting], Field(max_length=8), SetList()] = Field(
        default_factory=list,
        description="Settings in effect that the new mode has no counterpart for, accepted as "
        "lost: ipvsScheduler (an ipvs scheduler other than rr), ipvsTimeouts (ipvs tcpTimeout, "
        "tcpFinTimeout, udpTimeout), localhostNodePorts (NodePorts on 127.0.0.1; a switch to "
        "nftables with nftables.localhostNodePorts true carries them over). "
        "While the agents' configuration in effect has one that the new mode drops and it is "
        "not listed here, the operator does not apply the new spec (the agents keep the old "
        "mode) and condition Preflight says what to accept.",
    )
    progress_deadline_seconds: int = Field(
        default=DEFAULT_PROGRESS_DEADLINE,
        ge=5,
        le=3600,
        strict=True,
        description="Seconds an agent of the new mode may run on a node without a verified "
        "first sync (its rules programmed and found in the kernel) before that node is judged "
        "failed: its agent rolls it back to the old mode (rollbackOnFailure), and "
        "status.modeSwitch shows it RolledBack, or Stuck without rollback.",
    )
    rollback_on_failure: bool = Field(
        default=True,
        strict=True,
        description="A node whose agent of the new mode has no verified sync within "
        "progressDeadlineSeconds goes back to the old mode: that agent stops programming the "
        "new mode, programs the old mode's rules (which stayed in place) from then on, "
        "removes what the new mode left, and stays not Ready, so the rollout stops there. "
        "It stays so until its Pod is replaced (fix the node and delete the Pod, or set "
        "spec.mode back). false: the node is reported Stuck and keeps retrying the new mode.",
    )


class DeletionPolicy(StrEnum):
    """What deleting the ProxyConfiguration does to its agents and their rules."""

    #: The agents' DaemonSet and ConfigMap are left in place, without an owner: the agents keep
    #: serving Services, their rules stay (the safe default: a prune or a wrong
    #: `kubectl delete` is no outage).
    ORPHAN = "Orphan"
    #: The agents are stopped and their rules removed, node by node (maxUnavailable at a time;
    #: with takeover.moveKubeProxyOff, once kube-proxy is back and Ready on the node).
    CLEANUP = "Cleanup"


class ProxyConfigurationSpec(ProxySettings):
    """Desired state: the proxy mode and its settings, and where the agents run."""

    node_selector: LabelMap = Field(
        default_factory=dict,
        description="Run agents only on nodes with all these labels (empty: every node).",
    )
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(
        default_factory=list,
        description="Taints the agent pods tolerate, e.g. [{operator: Exists}] for every node.",
    )
    priority_class_name: DNSSubdomain = Field(
        default=DEFAULT_PRIORITY_CLASS,
        description="PriorityClass of the agent pods.",
    )
    resources: ResourceRequirements = Field(
        default_factory=default_agent_resources,
        description="Compute resources (requests and limits) of the agent container. Default "
        "(when the field is left out): requests cpu 50m and memory 64Mi, limit memory 384Mi, "
        "2.7 times the nftables agent's measured peak at 10,000 Services (143 MB, a relist "
        "included; the iptables agent's is about 280 MB); the nftables peak grows by about "
        "8.4 MB per 1,000 Services (307 MB at 30,000). {} sets none.",
    )
    image: Image | None = Field(
        default=None,
        description="Container image of the agents, overriding the operator's (its "
        "--agent-image: the agent of the operator's own release). Leave it out so that "
        "upgrading the operator moves the agents to its version.",
    )
    max_unavailable: IntOrPercent = Field(
        default=1,
        description="Agents that may be down at once during a rollout: a number of nodes (>= 1) "
        'or a percentage of them ("1%" to "100%").',
    )
    mode_switch: ModeSwitch = Field(
        default_factory=ModeSwitch,
        description="A change of mode that drops settings in effect (docs/migrating.md).",
    )
    deletion_policy: DeletionPolicy = Field(
        default=DeletionPolicy.ORPHAN,
        description="What deleting this ProxyConfiguration does. Orphan (default): its agents' "
        "DaemonSet and ConfigMap stay, without an owner, so the agents keep serving Services "
        "(re-creating a ProxyConfiguration of the same name adopts them). Cleanup: the agents "
        "stop and their rules are removed node by node, maxUnavailable nodes at a time; with "
        "takeover.moveKubeProxyOff, a node's rules go only once kube-proxy is Ready there "
        "again (docs/operator.md, Deletion).",
    )


class ConditionType(StrEnum):
    """Condition types the operator reports (others may be added)."""

    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    DEPRECATED = "Deprecated"
    #: Present once agents report which modes their nodes can run, or while a switch is held.
    PREFLIGHT = "Preflight"
    #: Present while and after a change of spec.mode (status.modeSwitch): False names a stuck
    #: node, why and what to do.
    MODE_SWITCH = "ModeSwitch"
    #: kstatus (sigs.k8s.io/cli-utils): True while the operator works towards the spec (agents
    #: roll out, a mode switch runs, a failed pass is retried); False otherwise.
    RECONCILING = "Reconciling"
    #: kstatus: True when the operator cannot make progress without a change from a person
    #: (the reason says which); False otherwise.
    STALLED = "Stalled"


class ConditionStatus(StrEnum):
    """Whether a condition holds."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


CONDITION_TYPE_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
REASON_PATTERN: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(KpxModel):
    """One aspect of the state (the Kubernetes metav1.Condition shape)."""

    type: Annotated[
        str,
        Text(
            max_length=316,
            pattern=CONDITION_TYPE_PATTERN,
            message="must be a CamelCase condition type such as Ready",
        ),
    ] = Field(
        description="Condition type: Ready, Progressing, Degraded, Deprecated, Reconciling, "
        "Stalled, Preflight or ModeSwitch."
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: Annotated[
        str,
        Text(
            max_length=1024,
            min_length=1,
            pattern=REASON_PATTERN,
            message="must be a CamelCase reason such as RolloutComplete",
        ),
    ] = Field(description="CamelCase reason of the last transition, for machines.")
    message: Annotated[str, Text(max_length=32768, message="")] = Field(
        default="", description="Details of the last transition, for humans."
    )
    last_transition_time: Timestamp = Field(description="When the status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="metadata.generation of the spec the condition was computed from.",
    )


class ModeSwitchPhase(StrEnum):
    """Where a node is in a change of spec.mode (from its agent Pod and that Pod's Events)."""

    PENDING = "Pending"  # its agent runs the old mode (or none runs yet)
    SWITCHING = "Switching"  # an agent of the new mode runs; not verified, or the old rules stay
    SWITCHED = "Switched"  # it verified its first sync and removed the old mode's rules
    STUCK = "Stuck"  # an agent of the new mode has not verified a sync for too long
    ROLLED_BACK = "RolledBack"  # its agent of the new mode went back to the old mode


class ModeSwitchNode(KpxModel):
    """One node's progress in a change of spec.mode."""

    name: DNSSubdomain = Field(description="The node.")
    phase: ModeSwitchPhase = Field(description="Pending, Switching, Switched, Stuck or RolledBack.")
    message: Annotated[str, Text(max_length=1024, message="")] = Field(
        default="",
        description="Why it is in this phase (for Stuck and RolledBack: the agent's error, and "
        "what to do).",
    )


class ModeSwitchStatus(KpxModel):
    """A change of spec.mode: per-node phase while it runs, a summary at the end."""

    from_mode: Mode = Field(description="The mode the agents ran before the change.")
    to_mode: Mode = Field(description="spec.mode: the mode the nodes move to.")
    started_at: Timestamp = Field(description="When the operator applied the new mode.")
    finished_at: Timestamp | None = Field(
        default=None, description="When every node was Switched (absent while it runs)."
    )
    nodes: Annotated[list[ModeSwitchNode], Field(max_length=5000)] = Field(
        default_factory=list,
        description="Each node with an agent of this configuration, by name (at most 5000, "
        "the furthest behind first).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    switched: int = Field(default=0, ge=0, strict=True, description="Nodes Switched.")
    summary: Annotated[str, Text(max_length=1024, message="")] = Field(
        default="",
        description='How many nodes are in each phase, e.g. "2 of 3 nodes '
        'switched from iptables to nftables (1 Stuck)".',
    )


#: status.conditions as the apiserver shows them until the operator writes a status (the CRD's
#: default, kpx_api.crdgen): kstatus (Flux, kpt) reads an object without conditions as Current,
#: this one as InProgress. The operator's status always has observedGeneration; this one has not.
UNSEEN_CONDITIONS: Final = (
    {
        "type": "Reconciling",
        "status": "True",
        "reason": "NotYetSeen",
        "message": "the operator has not written a status for this ProxyConfiguration yet",
        "lastTransitionTime": "1970-01-01T00:00:00Z",
    },
)


class ProxyConfigurationStatus(KpxModel):
    """Observed state, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, strict=True, description="Last metadata.generation acted upon."
    )
    conditions: Annotated[list[Condition], Field(max_length=16)] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, Deprecated, Reconciling and Stalled "
        "conditions (Preflight and ModeSwitch when they apply), one per type.",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    mode: Mode | None = Field(default=None, description="Mode the running agents use.")
    desired_nodes: int | None = Field(
        default=None, ge=0, strict=True, description="Nodes that should run an agent."
    )
    ready_nodes: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="Nodes whose agent runs the current configuration and is ready.",
    )
    deprecated: bool | None = Field(
        default=None,
        strict=True,
        description="True when the configuration uses a mode deprecated upstream (ipvs).",
    )
    takeover: TakeoverStatus | None = Field(
        default=None,
        description="spec.takeover.fromKubeProxy: each node's progress (docs/migrating.md).",
    )
    mode_switch: ModeSwitchStatus | None = Field(
        default=None,
        description="The last change of spec.mode: each node's phase while it runs, and a "
        "summary once it finished (docs/migrating.md). Kept until the next change.",
    )
    kopf: dict[str, Any] | None = Field(
        default=None,
        description="Progress storage of the operator framework (kopf); not for users.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    def condition(self, type_: str) -> Condition | None:
        """The condition of this type, if any."""
        return next((c for c in self.conditions if c.type == type_), None)


class ProxyConfiguration(KpxModel):
    """How Services are proxied on the nodes that spec.nodeSelector selects: one agent per
    node, programming the dataplane of spec.mode. Cluster-scoped."""

    api_version: Literal["proxy.kpx.dev/v1alpha1"] = Field(
        default=API_VERSION, description="proxy.kpx.dev/v1alpha1"
    )
    kind: Literal["ProxyConfiguration"] = Field(default=KIND, description="ProxyConfiguration")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: ProxyConfigurationSpec = Field(description="Desired state.")
    status: ProxyConfigurationStatus | None = Field(default=None, description="Observed state.")


def parse_spec(data: Mapping[str, Any], source: str = "spec") -> ProxyConfigurationSpec:
    """Validate a spec (e.g. kopf's ``spec`` argument); `ConfigError` names each bad field."""
    try:
        return ProxyConfigurationSpec.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, source) from None
