"""Pure: status.modeSwitch, a change of spec.mode node by node, and condition ModeSwitch.

* `track`: whether a switch runs (or ran) and from which mode, from the status it last wrote
  and the mode in effect (the agents' ConfigMap as last applied) before this pass applies
  spec.mode.
* `node_phases`: each node's phase, from its *current* agent Pod (the mode in its command) and
  the node's ProxyNodeState as that Pod wrote it (status.agentPod.uid: a state written by an
  agent Pod that is gone no longer counts; kpx_api.nodestate):
  - Pending: the node's agent runs the old mode (or none runs there now);
  - Switching: an agent of the new mode runs and has not verified its first sync yet, or has
    and the old mode's rules are still in status.leftoversPending (with the removal's error);
  - Switched: it verified its first sync (status.firstSyncVerified) and the old mode's rules
    are no longer pending;
  - RolledBack: the agent of the new mode had no verified sync within
    spec.modeSwitch.progressDeadlineSeconds and went back to the old mode
    (status.rolledBack; it stays not Ready, so the rollout stops there); the message is the
    agent's and what to do;
  - Stuck: an agent of the new mode has run `stuck_after` seconds without a verified sync (so
    it is not Ready, and the DaemonSet's rolling update does not move past it) and did not
    roll back (rollbackOnFailure false: `stuck_after` is the deadline; with it, the deadline
    and ROLLBACK_GRACE more: an agent that cannot start cannot roll back); the message says
    why: the agent's status.lastError (the kernel's error), or its container's state.
  The agents still record Events (FirstSyncVerified, SyncFailed, RolledBack, ...) for people;
  the operator does not read those.
* `rollback`: the `rollback` block of the agents' configuration while a switch runs (the old
  mode: where to go back to, if enabled, and whose rules' removal the agents' readiness waits
  for).
* `switch_status`: status.modeSwitch (per-node phase, counts, a summary; finishedAt once every
  node is Switched).
* `condition`: ModeSwitch's (status, reason, message): False `NodeRolledBack` or `NodeStuck`
  naming the node, the agent's error and what to do; False `Switching` while it runs; True
  `Switched` after.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Final

from kpx_api.agentconfig import AgentConfiguration, Rollback
from kpx_api.modes import KERNEL_BACKEND_MODES, SETTINGS_CLASS, IPVSSettings, Mode
from kpx_api.nodestate import LeftoverState
from kpx_api.proxyconfiguration import (
    DEFAULT_PROGRESS_DEADLINE,
    ModeSwitchNode,
    ModeSwitchPhase,
    ModeSwitchStatus,
    ProxyConfigurationSpec,
)

from .admission import node_list
from .agent_reports import live_agents, node_states
from .builders import AGENT_CONTAINER

Phase = ModeSwitchPhase
#: Seconds an agent of the new mode may run without a verified sync before its node is Stuck
#: (spec.modeSwitch.progressDeadlineSeconds by default).
STUCK_AFTER: Final = float(DEFAULT_PROGRESS_DEADLINE)
#: With rollbackOnFailure, Stuck only this long after the deadline: the agent counts the
#: deadline from its own start, which comes after the Pod's (image, container), and reports its
#: rollback at once; an agent still not rolled back then could not (it does not run).
ROLLBACK_GRACE: Final = 15.0
#: status.modeSwitch.nodes holds at most this many (the CRD's maxItems).
MAX_LISTED: Final = 5000
_RANK: Final = {
    Phase.ROLLED_BACK: 0,
    Phase.STUCK: 0,
    Phase.PENDING: 1,
    Phase.SWITCHING: 2,
    Phase.SWITCHED: 3,
}


def track(
    previous: ModeSwitchStatus | None, in_effect: str | None, mode: str, held: bool, now: datetime
) -> ModeSwitchStatus | None:
    """The switch this pass reports on (None: none ran since the operator deployed the agents).
    `in_effect`: the mode of the agents' ConfigMap before this pass (None: none yet); `held`:
    preflight holds the switch (nothing new is applied)."""
    if in_effect and in_effect != mode and not held:
        if previous is not None and previous.to_mode == mode and previous.finished_at is None:
            return previous  # applied before, and the apply is being retried
        return ModeSwitchStatus(from_mode=in_effect, to_mode=mode, started_at=now)
    if previous is not None and (held or previous.to_mode == in_effect):
        return previous
    return None


def stuck_after(spec: ProxyConfigurationSpec) -> float:
    """Seconds without a verified sync after which a node of the switch is Stuck."""
    deadline = float(spec.mode_switch.progress_deadline_seconds)
    return deadline + ROLLBACK_GRACE if spec.mode_switch.rollback_on_failure else deadline


def rollback(
    spec: ProxyConfigurationSpec,
    switch: ModeSwitchStatus | None,
    in_effect: AgentConfiguration | None,
) -> Rollback | None:
    """The agents' `rollback` while `switch` runs towards spec.mode, `enabled` with
    rollbackOnFailure (None otherwise, or unless both modes have a kernel backend: an external
    backend is a container the new pod template no longer has). Also with rollbackOnFailure
    false it names the old mode: the agents' readiness waits for its rules' removal. The old
    mode's settings are those in
    effect before the switch: the spec may hold only the new mode's block, so they come from
    the agents' configuration as last applied (`in_effect`: the old mode's, or the rollback
    block of a pass that already applied the switch), else that mode's defaults."""
    if switch is None or switch.finished_at is not None or switch.to_mode != spec.mode:
        return None
    old = Mode(switch.from_mode)
    if {old, spec.mode} - KERNEL_BACKEND_MODES:
        return None
    block: object
    if in_effect is not None and in_effect.mode == old:
        block = in_effect.mode_settings()
    elif in_effect is not None and in_effect.rollback and in_effect.rollback.mode == old:
        block = in_effect.rollback.mode_settings()
    else:
        block = SETTINGS_CLASS[old]()  # type: ignore[call-arg]  # a kernel mode
    if isinstance(block, IPVSSettings):  # accepted when it ran
        block = block.model_copy(update={"acknowledge_deprecation": True})
    return Rollback.model_validate(
        {
            "mode": old,
            str(old): block,
            "enabled": spec.mode_switch.rollback_on_failure,
            "progressDeadlineSeconds": spec.mode_switch.progress_deadline_seconds,
        }
    )


def pod_mode(pod: Mapping[str, Any]) -> str:
    """The mode an agent Pod runs (`proxy-agent --mode M` in its agent container)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") != AGENT_CONTAINER:
            continue
        command = [str(c) for c in container.get("command") or []]
        for flag, value in itertools.pairwise(command):
            if flag == "--mode":
                return value
    return ""


def _parse_time(text: object) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def _container_trouble(pod: Mapping[str, Any]) -> str:
    """What the kubelet says of the agent container when it is not running (CrashLoopBackOff,
    ImagePullBackOff, ...), or ""."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != AGENT_CONTAINER:
            continue
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            detail = f": {waiting['message']}" if waiting.get("message") else ""
            return f"container {waiting['reason']}{detail}"
    return ""


def node_phases(
    pods: Iterable[Mapping[str, Any]],
    states: Iterable[Mapping[str, Any]],
    from_mode: str,
    to_mode: str,
    now: datetime,
    stuck_after: float = STUCK_AFTER,
) -> dict[str, tuple[Phase, str]]:
    """node -> (phase, message) for every node with a live agent Pod; `states`: the
    ProxyNodeState objects."""
    pods = list(pods)
    live = live_agents(pods, scheduled_only=True)
    by_uid = {str((p.get("metadata") or {}).get("uid")): p for p in pods}
    reported = node_states(states, live)
    out: dict[str, tuple[Phase, str]] = {}
    for uid, node in live.items():
        pod = by_uid[uid]
        mode = pod_mode(pod)
        if mode != to_mode:
            out[node] = (Phase.PENDING, f"its agent runs mode {mode or 'unknown'}")
            continue
        state = reported.get(uid)
        if state is not None and state.rolled_back:
            out[node] = (
                Phase.ROLLED_BACK,
                f"{state.rolled_back}. Its agent stays not Ready, "
                "so the rollout stops here. Fix the node, then delete its agent Pod "
                f"(the new one tries {to_mode} again), or set spec.mode back to "
                f"{from_mode}",
            )
            continue
        if state is not None and state.first_sync_verified:
            pending = {p.name: p for p in state.leftovers_pending}
            if from_mode not in pending:
                out[node] = (
                    Phase.SWITCHED,
                    f"mode {to_mode} verified, the {from_mode} rules removed",
                )
            elif pending[from_mode].state is LeftoverState.FAILING:
                out[node] = (Phase.SWITCHING, pending[from_mode].message)
            else:
                out[node] = (
                    Phase.SWITCHING,
                    f"mode {to_mode} verified; removing the {from_mode} rules",
                )
            continue
        started = _parse_time((pod.get("status") or {}).get("startTime")) or _parse_time(
            (pod.get("metadata") or {}).get("creationTimestamp")
        )
        age = (now - started).total_seconds() if started else 0.0
        if age < stuck_after:
            out[node] = (
                Phase.SWITCHING,
                f"its {to_mode} agent started, first sync not verified yet",
            )
            continue
        why = (
            state.last_error.message
            if state is not None and state.last_error is not None
            else _container_trouble(pod) or "no error reported"
        )
        out[node] = (
            Phase.STUCK,
            f"its {to_mode} agent has run {age:.0f}s without a verified sync (not Ready): {why}",
        )
    return out


def switch_status(
    switch: ModeSwitchStatus,
    phases: Mapping[str, tuple[Phase, str]],
    nodes: Iterable[str],
    now: datetime,
) -> ModeSwitchStatus:
    """status.modeSwitch for a running `switch`: the phases of the nodes with an agent, and
    Pending for the other nodes it listed before that still exist (their agent is being
    replaced); a node Switched before stays Switched while its agent restarts. finishedAt
    once every node is Switched; a finished switch is returned as it is."""
    if switch.finished_at is not None:
        return switch
    exists = set(nodes)
    merged = dict(phases)
    for before in switch.nodes:
        if before.name in merged or before.name not in exists:
            continue
        if before.phase is Phase.SWITCHED:
            merged[before.name] = (before.phase, before.message)
        else:
            merged[before.name] = (Phase.PENDING, "no agent runs on it now (being replaced)")
    listed = sorted(
        (ModeSwitchNode(name=n, phase=p, message=m[:1024]) for n, (p, m) in merged.items()),
        key=lambda n: (_RANK[n.phase], n.name),
    )[:MAX_LISTED]
    counts: dict[Phase, int] = {}
    for phase, _ in merged.values():
        counts[phase] = counts.get(phase, 0) + 1
    switched = counts.get(Phase.SWITCHED, 0)
    done = bool(merged) and switched == len(merged)
    summary = (
        f"{switched} of {len(merged)} nodes switched from {switch.from_mode} to {switch.to_mode}"
    )
    others = [
        f"{counts[p]} {p.value}"
        for p in sorted(counts, key=_RANK.__getitem__)
        if p is not Phase.SWITCHED
    ]
    if others:
        summary += f" ({', '.join(others)})"
    if done:
        seconds = (now - switch.started_at).total_seconds()
        summary += f" in {seconds:.0f}s"
    return ModeSwitchStatus(
        from_mode=switch.from_mode,
        to_mode=switch.to_mode,
        started_at=switch.started_at,
        finished_at=now if done else None,
        nodes=sorted(listed, key=lambda n: n.name),
        switched=switched,
        summary=summary,
    )


def stuck(status: ModeSwitchStatus) -> list[ModeSwitchNode]:
    return [n for n in status.nodes if n.phase is Phase.STUCK]


def rolled_back(status: ModeSwitchStatus) -> list[ModeSwitchNode]:
    return [n for n in status.nodes if n.phase is Phase.ROLLED_BACK]


def condition(status: ModeSwitchStatus) -> tuple[str, str, str]:
    """(status True/False, reason, message) of condition ModeSwitch."""
    if status.finished_at is not None:
        return ("True", "Switched", status.summary)
    old, new = status.from_mode, status.to_mode
    back = rolled_back(status)
    if back:
        names = node_list(n.name for n in back)
        where = f"node {names}" if len(back) == 1 else f"nodes {names}"
        return (
            "False",
            "NodeRolledBack",
            f"the switch to mode {new} failed on {where}, which went back to {old}: "
            f"{back[0].message}. {status.summary}",
        )
    nodes = stuck(status)
    if not nodes:
        return ("False", "Switching", status.summary)
    names = node_list(n.name for n in nodes)
    where = f"node {names}" if len(nodes) == 1 else f"nodes {names}"
    return (
        "False",
        "NodeStuck",
        f"the switch to mode {new} is stuck on {where}: {nodes[0].message}. The rollout "
        f"stops there (its agent is not Ready) and the node keeps serving on its {old} rules. "
        f"Fix the node (the agent retries by itself), or set spec.mode back to {old}: the "
        f"agents then roll back to {old}, that node first. {status.summary}",
    )
