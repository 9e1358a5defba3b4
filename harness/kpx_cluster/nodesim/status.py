"""Pod and container status as a kubelet reports it (pure: no I/O, no clock reads).

The kubelet code (nodesim.container, nodesim.pod) keeps the facts (what runs, what ended, what
waits and why); these functions turn them into the API's shapes: a container's state (waiting
with a reason such as ContainerCreating, CreateContainerConfigError, ErrImagePull,
ImagePullBackOff or CrashLoopBackOff; running; terminated), its containerStatuses entry, the
pod's phase and its conditions.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

# Waiting reasons, as the kubelet spells them.
CONTAINER_CREATING = "ContainerCreating"
POD_INITIALIZING = "PodInitializing"
CONFIG_ERROR = "CreateContainerConfigError"
ERR_IMAGE_PULL = "ErrImagePull"
IMAGE_PULL_BACKOFF = "ImagePullBackOff"
CRASH_LOOP_BACKOFF = "CrashLoopBackOff"


@dataclass(frozen=True)
class Exit:
    """How a container's process ended."""

    exit_code: int
    signal: int | None
    started_at: str
    finished_at: str
    start_error: str = ""
    """Set when the process could not even start (e.g. "StartError")."""


def exit_reason(exit: Exit) -> str:
    """terminated.reason: the start error, else Completed (0) or Error."""
    if exit.start_error:
        return exit.start_error
    return "Completed" if exit.exit_code == 0 else "Error"


def terminated_state(exit: Exit, container_id: str = "") -> Obj:
    """The `terminated` object of a container state."""
    state: Obj = {
        "exitCode": exit.exit_code,
        "reason": exit_reason(exit),
        "startedAt": exit.started_at,
        "finishedAt": exit.finished_at,
    }
    if exit.signal is not None:
        state["signal"] = exit.signal
        state["message"] = f"killed by {signal.Signals(exit.signal).name}"
    if container_id:
        state["containerID"] = container_id
    return state


def waiting_state(reason: str, message: str = "") -> Obj:
    """The `waiting` object of a container state (reason defaults to ContainerCreating)."""
    waiting: Obj = {"reason": reason or CONTAINER_CREATING}
    if message:
        waiting["message"] = message
    return waiting


def crash_loop_message(backoff: float, container: str) -> str:
    return f"back-off {backoff:.0f}s restarting failed container={container}"


def image_pull_waiting(image: str, error: str, backing_off: bool) -> tuple[str, str]:
    """(reason, message) of a container whose image could not be pulled: right after a failed
    attempt the kubelet reports ErrImagePull with the error; while it waits for the next
    attempt, ImagePullBackOff."""
    if not backing_off:
        return ERR_IMAGE_PULL, error
    return IMAGE_PULL_BACKOFF, f'Back-off pulling image "{image}": {error}'


def next_backoff(current: float, maximum: float) -> float:
    """The kubelet's back-off: doubled each time, capped."""
    return min(current * 2, maximum)


@dataclass(frozen=True)
class ContainerFacts:
    """What the kubelet knows about one container, to report it."""

    name: str
    image: str
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    last_state: Obj | None = None
    running_since: str | None = None
    """startedAt of the running process, None when nothing runs."""
    terminated: Obj | None = None
    """The terminated state, when the container stays terminated."""
    waiting: tuple[str, str] = (CONTAINER_CREATING, "")
    container_id: str = ""
    image_id: str = ""


def container_status(facts: ContainerFacts) -> Obj:
    """One entry of status.containerStatuses (running wins over terminated over waiting)."""
    status: Obj = {
        "name": facts.name,
        "image": facts.image,
        "imageID": facts.image_id,
        "ready": facts.ready,
        "started": facts.started,
        "restartCount": facts.restart_count,
        "lastState": facts.last_state or {},
    }
    if facts.container_id:
        status["containerID"] = facts.container_id
    if facts.running_since is not None:
        status["state"] = {"running": {"startedAt": facts.running_since}}
    elif facts.terminated is not None:
        status["state"] = {"terminated": facts.terminated}
    else:
        status["state"] = {"waiting": waiting_state(*facts.waiting)}
    return status


def pod_phase(
    containers: Sequence[Mapping[str, Any]], init_failed: bool, final: bool = False
) -> str:
    """The pod's phase from its regular containers' statuses (containerStatuses entries).
    `final`: the pod is being torn down for good (every container has stopped)."""
    if init_failed:
        return "Failed"
    ended = [c["state"].get("terminated") for c in containers]
    if final or (containers and all(t is not None for t in ended)):
        if containers and all(t is not None and t["exitCode"] == 0 for t in ended):
            return "Succeeded"
        return "Failed"
    if any("running" in c["state"] or c["restartCount"] or c["lastState"] for c in containers):
        return "Running"
    return "Pending"


def condition(kind: str, ok: bool, reason: str, transition: str) -> Obj:
    """One pod condition; `reason` None-d when empty (a strategic merge patch then removes a
    stale one: conditions merge by type)."""
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "lastProbeTime": None,
        "lastTransitionTime": transition,
        "reason": reason or None,
    }


def pod_conditions(
    *,
    sandbox_ready: bool,
    initialized: bool,
    containers_ready: bool,
    gates_ok: bool,
    terminal: bool,
) -> list[tuple[str, bool, str]]:
    """(type, ok, reason) of PodReadyToStartContainers, Initialized, ContainersReady, Ready."""
    reason = "PodCompleted" if terminal else ""
    not_ready = reason or "ContainersNotReady"
    containers_ready = containers_ready and not terminal
    ready = containers_ready and gates_ok
    return [
        ("PodReadyToStartContainers", sandbox_ready and not terminal, ""),
        ("Initialized", initialized, reason),
        ("ContainersReady", containers_ready, "" if containers_ready else not_ready),
        ("Ready", ready, "" if ready else not_ready),
    ]


def transition_time(previous: tuple[str, str] | None, ok: bool, now: str) -> tuple[str, str]:
    """(status, lastTransitionTime) of a condition: the time moves only when the status does."""
    value = "True" if ok else "False"
    if previous is None or previous[0] != value:
        return value, now
    return previous
