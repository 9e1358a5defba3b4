"""Pure: a ProxyConfiguration's status from what was decided and observed.

Conditions follow the Kubernetes conventions (metav1.Condition): one per type, always these six
(Ready, Progressing, Degraded, Deprecated, and kstatus' Reconciling and Stalled), each with the
generation it was computed from, and a lastTransitionTime that moves only when its status flips.

Reconciling and Stalled carry the meaning sigs.k8s.io/cli-utils' kstatus gives them (Flux, kpt
and `helm --wait` read them): "abnormal-true" conditions, False when all is well. Reconciling is
True while the operator works towards the spec (agents roll out, a mode switch runs, a failed
pass is retried); Stalled is True when it cannot make progress without a change from a person
(an invalid spec, ipvs denied, a mode without backend, a node conflict, conntrack settings the
agents cannot apply, a held or stuck mode switch, a rollout past its deadline). At most one of
the two is True: kstatus reads the first True one in list order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from kpx_api import (
    Condition,
    ConditionStatus,
    ConditionType,
    Mode,
    ProxyConfigurationStatus,
    no_backend_message,
)
from kpx_api.proxyconfiguration import ModeSwitchStatus
from kpx_api.takeover import TakeoverStatus

from .admission import Admission, conflict_message
from .agent_reports import NodeProblem, conntrack_message
from .mode_switch import condition as mode_switch_condition
from .preflight import Preflight
from .preflight import condition as preflight_condition

TRUE, FALSE = ConditionStatus.TRUE, ConditionStatus.FALSE

NFTABLES_ADVICE: Final = (
    "mode ipvs is deprecated upstream: migrate to mode nftables (recommended), the "
    "dataplane kpx is built around"
)
IPVS_DENIED_MESSAGE: Final = (
    "mode ipvs is denied by the operator (--ipvs-policy=deny), so nothing is deployed; "
    "mode ipvs is deprecated upstream: use mode nftables (recommended)"
)

#: Seconds a rollout may go without progress (no node more updated or ready) before Stalled says
#: RolloutDeadlineExceeded (as a Deployment's progressDeadlineSeconds; --rollout-deadline).
DEFAULT_ROLLOUT_DEADLINE: Final = 600.0

#: Degraded reasons that only a person's change ends (each also makes Stalled True; a
#: NodeConflict only on the side whose agents are kept off nodes).
NEEDS_A_PERSON: Final = frozenset(
    {"InvalidSpec", "IPVSDenied", "ModeNotImplemented", "ConntrackNotApplied"}
)
#: ModeSwitch reasons of a switch that stopped (the message says what to do).
SWITCH_STOPPED: Final = frozenset({"NodeRolledBack", "NodeStuck"})

CondTuple = tuple[ConditionType, ConditionStatus, str, str]


@dataclass(frozen=True)
class Rollout:
    """The agent DaemonSet's rollout, as its status reports it."""

    current: bool  # the DaemonSet controller has seen the latest template
    desired: int
    updated: int
    ready: int

    @classmethod
    def from_daemonset(cls, ds: Mapping[str, Any]) -> Rollout:
        meta, status = ds.get("metadata") or {}, ds.get("status") or {}
        generation = int(meta.get("generation") or 0)
        observed = status.get("observedGeneration")
        return cls(
            current=observed is not None and int(observed) >= generation,
            desired=int(status.get("desiredNumberScheduled") or 0),
            updated=int(status.get("updatedNumberScheduled") or 0),
            ready=int(status.get("numberReady") or 0),
        )

    @property
    def ready_current(self) -> int:
        """Nodes whose agent runs the current template and is ready (a lower bound while
        old and new pods are mixed: every not-updated pod might be one of the ready ones)."""
        if not self.current:
            return 0
        return min(self.updated, max(0, self.ready - (self.desired - self.updated)))

    @property
    def complete(self) -> bool:
        return self.current and self.updated == self.desired and self.ready == self.desired


@dataclass(frozen=True)
class Observed:
    """Everything the status is computed from."""

    generation: int
    mode: str
    admission: Admission
    daemonset: Mapping[str, Any] | None = None  # the agent DaemonSet as read; None: absent
    error: str | None = None  # why the last reconcile failed (e.g. an apply was refused)
    invalid: str | None = None  # why the spec does not validate (the apiserver should refuse)
    #: Nodes whose agent reports that it could not apply spec.conntrack (agent_reports.py).
    conntrack_problems: tuple[NodeProblem, ...] = ()
    #: spec.takeover.fromKubeProxy: each node's progress (takeover.py); None when off.
    takeover: TakeoverStatus | None = None
    #: Which nodes cannot run spec.mode, a held mode switch (preflight.py); None: unknown.
    preflight: Preflight | None = None
    #: The last change of spec.mode (mode_switch.py); None: none since the agents were deployed.
    mode_switch: ModeSwitchStatus | None = None
    #: Seconds the rollout may go without progress before Stalled (None: no deadline).
    rollout_deadline: float | None = DEFAULT_ROLLOUT_DEADLINE
    #: When the rollout last made progress (a node more updated or ready); None: unknown, then
    #: since Progressing became True.
    last_progress: datetime | None = None


def _cond(type_: ConditionType, status: ConditionStatus, reason: str, message: str) -> CondTuple:
    return (type_, status, reason, message)


def conditions_for(obs: Observed) -> list[CondTuple]:
    """(type, status, reason, message) of each condition: Ready, Progressing, Degraded,
    Deprecated."""
    ready, progressing = ConditionType.READY, ConditionType.PROGRESSING
    degraded, deprecated = ConditionType.DEGRADED, ConditionType.DEPRECATED
    adm = obs.admission
    out: list[CondTuple] = []
    if obs.mode == Mode.IPVS:
        out.append(_cond(deprecated, TRUE, "IPVSDeprecated", NFTABLES_ADVICE))
    else:
        out.append(_cond(deprecated, FALSE, "ModeSupported", f"mode {obs.mode} is supported"))

    if obs.invalid is not None:
        message = f"the spec does not validate, nothing is deployed: {obs.invalid}"
        return [
            _cond(ready, FALSE, "InvalidSpec", message),
            _cond(progressing, FALSE, "InvalidSpec", message),
            _cond(degraded, TRUE, "InvalidSpec", message),
            *out,
        ]
    if adm.ipvs_denied:
        message = IPVS_DENIED_MESSAGE
        return [
            _cond(ready, FALSE, "IPVSDenied", message),
            _cond(progressing, FALSE, "IPVSDenied", message),
            _cond(degraded, TRUE, "IPVSDenied", message),
            *out,
        ]
    if adm.no_backend:
        message = f"nothing is deployed: {no_backend_message(obs.mode)}"
        return [
            _cond(ready, FALSE, "ModeNotImplemented", message),
            _cond(progressing, FALSE, "ModeNotImplemented", message),
            _cond(degraded, TRUE, "ModeNotImplemented", message),
            *out,
        ]
    if obs.error is not None:
        out.insert(0, _cond(degraded, TRUE, "ReconcileFailed", obs.error))
    elif obs.conntrack_problems:
        message = conntrack_message(obs.conntrack_problems)
        out.insert(0, _cond(degraded, TRUE, "ConntrackNotApplied", message))
    elif adm.overlaps:
        out.insert(0, _cond(degraded, TRUE, "NodeConflict", conflict_message(adm)))
    else:
        out.insert(0, _cond(degraded, FALSE, "AsExpected", "no known problem"))

    if obs.daemonset is None:
        waiting = "the agent DaemonSet does not exist yet"
        return [
            _cond(ready, FALSE, "AgentsNotDeployed", waiting),
            _cond(progressing, TRUE, "RollingOut", waiting),
            *out,
        ]
    r = Rollout.from_daemonset(obs.daemonset)
    if not r.current:
        waiting = "the DaemonSet controller has not seen the latest agent template yet"
        return [
            _cond(ready, FALSE, "RollingOut", waiting),
            _cond(progressing, TRUE, "RollingOut", waiting),
            *out,
        ]
    if r.desired == 0:
        message = "no node matches spec.nodeSelector and spec.tolerations: no agent runs"
        if adm.kept_out:
            message = (
                "no agent runs: its nodes match spec.nodeSelector and spec.tolerations but "
                "older ProxyConfigurations run there (NodeConflict)"
            )
        return [
            _cond(ready, FALSE, "NoMatchingNodes", message),
            _cond(progressing, FALSE, "NoMatchingNodes", message),
            *out,
        ]
    counts = f"{r.updated} of {r.desired} nodes run the current agent, {r.ready} agents ready"
    if r.complete:
        return [
            _cond(ready, TRUE, "AllAgentsReady", counts),
            _cond(progressing, FALSE, "RolloutComplete", counts),
            *out,
        ]
    return [
        _cond(ready, FALSE, "AgentsNotReady", counts),
        _cond(progressing, TRUE, "RollingOut", counts),
        *out,
    ]


def kstatus_conditions(
    found: list[CondTuple],
    progressing_since: datetime | None,
    now: datetime,
    deadline: float | None,
    kept_out: bool = False,
) -> list[CondTuple]:
    """Reconciling and Stalled (kstatus) from the other conditions; `progressing_since`: since
    when Progressing is True without progress (None: it is not True); `kept_out`: a conflict
    keeps this configuration's agents off some of its nodes (the older side of a conflict runs
    on all its nodes: nothing stalls there)."""
    by_type = {c[0]: c for c in found}
    reconciling, stalled = ConditionType.RECONCILING, ConditionType.STALLED

    def said(type_: ConditionType, status: ConditionStatus) -> CondTuple | None:
        c = by_type.get(type_)
        return c if c is not None and c[1] == status else None

    degraded = said(ConditionType.DEGRADED, TRUE)
    preflight = said(ConditionType.PREFLIGHT, FALSE)
    switch = said(ConditionType.MODE_SWITCH, FALSE)
    progressing = said(ConditionType.PROGRESSING, TRUE)
    stall: tuple[str, str] | None = None
    if degraded is not None and (
        degraded[2] in NEEDS_A_PERSON or (degraded[2] == "NodeConflict" and kept_out)
    ):
        stall = (degraded[2], degraded[3])
    elif preflight is not None:
        stall = (preflight[2], preflight[3])
    elif switch is not None and switch[2] in SWITCH_STOPPED:
        stall = (switch[2], switch[3])
    elif (
        progressing is not None
        and progressing_since is not None
        and deadline is not None
        and now - progressing_since > timedelta(seconds=deadline)
    ):
        stall = (
            "RolloutDeadlineExceeded",
            f"the rollout made no progress for {deadline:g}s: {progressing[3]}",
        )
    if stall is not None:
        return [
            _cond(reconciling, FALSE, "Stalled", "the operator waits for a change: see Stalled"),
            _cond(stalled, TRUE, *stall),
        ]
    not_stalled = _cond(stalled, FALSE, "AsExpected", "no problem needs a change from a person")
    if degraded is not None and degraded[2] == "ReconcileFailed":
        work: tuple[str, str] | None = ("ReconcileFailed", f"retrying: {degraded[3]}")
    elif progressing is not None:
        work = (progressing[2], progressing[3])
    elif switch is not None:
        work = ("ModeSwitching", switch[3])
    else:
        work = None
    if work is not None:
        return [_cond(reconciling, TRUE, *work), not_stalled]
    return [
        _cond(reconciling, FALSE, "Reconciled", "nothing left to do for this generation"),
        not_stalled,
    ]


def compute_status(
    obs: Observed, previous: ProxyConfigurationStatus | None, now: datetime
) -> ProxyConfigurationStatus:
    """The status to write. `previous` keeps lastTransitionTime of conditions whose status
    did not change; `now` stamps the others."""
    conditions = []
    found = conditions_for(obs)
    said = preflight_condition(obs.preflight) if obs.preflight is not None else None
    if said is not None and obs.invalid is None and obs.admission.deploy:
        found.append((ConditionType.PREFLIGHT, ConditionStatus(said[0]), said[1], said[2]))
    deployed = obs.invalid is None and obs.admission.deploy
    if obs.mode_switch is not None and deployed:
        switch = mode_switch_condition(obs.mode_switch)
        found.append((ConditionType.MODE_SWITCH, ConditionStatus(switch[0]), switch[1], switch[2]))

    def since(type_: ConditionType, status: ConditionStatus) -> datetime:
        before = previous.condition(type_) if previous is not None else None
        return before.last_transition_time if before and before.status == status else now

    progressing = next((c for c in found if c[0] == ConditionType.PROGRESSING), None)
    progressing_since: datetime | None = None
    if progressing is not None and progressing[1] == TRUE:
        progressing_since = since(ConditionType.PROGRESSING, TRUE)
        if obs.last_progress is not None:
            progressing_since = max(progressing_since, obs.last_progress)
    found += kstatus_conditions(
        found, progressing_since, now, obs.rollout_deadline, bool(obs.admission.kept_out)
    )
    for type_, status, reason, message in found:
        conditions.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=since(type_, status),
                observed_generation=obs.generation,
            )
        )
    rollout = (
        Rollout.from_daemonset(obs.daemonset) if deployed and obs.daemonset is not None else None
    )
    return ProxyConfigurationStatus(
        observed_generation=obs.generation,
        conditions=conditions,
        mode=Mode(obs.mode) if deployed and obs.mode in set(Mode) else None,
        desired_nodes=rollout.desired if rollout and rollout.current else 0,
        ready_nodes=rollout.ready_current if rollout else 0,
        deprecated=obs.mode == Mode.IPVS,
        takeover=obs.takeover if deployed else None,
        mode_switch=obs.mode_switch if deployed else None,
    )


def status_patch(status: ProxyConfigurationStatus) -> dict[str, Any]:
    """A JSON merge patch for .status: absent fields are sent as null (removed); kopf's own
    storage (status.kopf) is left alone."""
    return status.model_dump(mode="json", by_alias=True, exclude={"kopf"})


def parse_status(data: Mapping[str, Any] | None) -> ProxyConfigurationStatus | None:
    """The status as the operator stored it: None when absent, unreadable, or not the
    operator's (no observedGeneration: the CRD's default, kpx_api.UNSEEN_CONDITIONS, or only
    kopf's bookkeeping); then every condition is new."""
    if not data or data.get("observedGeneration") is None:
        return None
    try:
        return ProxyConfigurationStatus.model_validate(dict(data))
    except ValueError:
        return None


def is_current(stored: Mapping[str, Any] | None, status: ProxyConfigurationStatus) -> bool:
    """Whether the stored status already says what `status` says (then no write is needed)."""
    mine = {k: v for k, v in status_patch(status).items() if v is not None}
    theirs = {k: v for k, v in (stored or {}).items() if k != "kopf" and v is not None}
    return mine == theirs
