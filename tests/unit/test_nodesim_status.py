"""The node simulator's pod and container status, as a kubelet reports it (pure)."""

from __future__ import annotations

import signal

from kpx_cluster.nodesim import status as st


def _entry(**kw: object) -> dict[str, object]:
    return st.container_status(st.ContainerFacts("c", "img", **kw))  # type: ignore[arg-type]


def test_a_new_container_waits_creating() -> None:
    got = _entry()
    assert got["state"] == {"waiting": {"reason": "ContainerCreating"}}
    assert (got["ready"], got["started"], got["restartCount"], got["lastState"]) == (
        False,
        False,
        0,
        {},
    )
    assert "containerID" not in got


def test_running_wins_over_terminated_and_waiting() -> None:
    got = _entry(
        running_since="t1",
        terminated={"exitCode": 1},
        waiting=("X", "y"),
        container_id="runc://a",
        restart_count=2,
        ready=True,
    )
    assert got["state"] == {"running": {"startedAt": "t1"}}
    assert (got["containerID"], got["restartCount"], got["ready"]) == ("runc://a", 2, True)


def test_terminated_by_a_signal_reports_128_plus_and_the_signal() -> None:
    exit = st.Exit(128 + 15, signal.SIGTERM, "t0", "t1")
    got = st.terminated_state(exit, "sim://9")
    assert got == {
        "exitCode": 143,
        "reason": "Error",
        "startedAt": "t0",
        "finishedAt": "t1",
        "signal": 15,
        "message": "killed by SIGTERM",
        "containerID": "sim://9",
    }
    assert st.terminated_state(st.Exit(0, None, "a", "b"))["reason"] == "Completed"
    assert st.terminated_state(st.Exit(128, None, "a", "b", "StartError"))["reason"] == "StartError"


def test_image_pull_errors_then_backs_off() -> None:
    first = st.image_pull_waiting("ghcr.io/x/y:1", "not among the built images", False)
    assert first == ("ErrImagePull", "not among the built images")
    later = st.image_pull_waiting("ghcr.io/x/y:1", "not among the built images", True)
    assert later[0] == "ImagePullBackOff"
    assert later[1] == 'Back-off pulling image "ghcr.io/x/y:1": not among the built images'
    entry = _entry(waiting=later)
    assert entry["state"]["waiting"]["reason"] == "ImagePullBackOff"  # type: ignore[index]


def test_crash_loop_backoff_doubles_up_to_the_cap() -> None:
    assert [st.next_backoff(b, 10) for b in (1, 2, 4, 8, 10)] == [2, 4, 8, 10, 10]
    assert st.crash_loop_message(4, "agent") == "back-off 4s restarting failed container=agent"
    entry = _entry(
        waiting=(st.CRASH_LOOP_BACKOFF, "m"),
        restart_count=3,
        last_state={"terminated": {"exitCode": 1}},
    )
    assert entry["state"] == {"waiting": {"reason": "CrashLoopBackOff", "message": "m"}}
    assert st.pod_phase([entry], init_failed=False) == "Running"


def test_pod_phase() -> None:
    waiting = _entry()
    running = _entry(running_since="t")
    ok = _entry(terminated={"exitCode": 0})
    failed = _entry(terminated={"exitCode": 2})
    assert st.pod_phase([], False) == "Pending"
    assert st.pod_phase([waiting], False) == "Pending"
    assert st.pod_phase([running, ok], False) == "Running"
    assert st.pod_phase([ok, ok], False) == "Succeeded"
    assert st.pod_phase([ok, failed], False) == "Failed"
    assert st.pod_phase([running], True) == "Failed"  # torn down before it completed
    assert st.pod_phase([waiting], False, final=False) == "Pending"
    assert st.pod_phase([ok], init_failed=True) == "Failed"


def test_pod_conditions() -> None:
    ready = st.pod_conditions(
        sandbox_ready=True, initialized=True, containers_ready=True, gates_ok=True, terminal=False
    )
    assert ready == [
        ("PodReadyToStartContainers", True, ""),
        ("Initialized", True, ""),
        ("ContainersReady", True, ""),
        ("Ready", True, ""),
    ]
    gated = st.pod_conditions(
        sandbox_ready=True, initialized=True, containers_ready=True, gates_ok=False, terminal=False
    )
    assert gated[2] == ("ContainersReady", True, "")
    assert gated[3] == ("Ready", False, "ContainersNotReady")
    done = st.pod_conditions(
        sandbox_ready=True, initialized=True, containers_ready=True, gates_ok=True, terminal=True
    )
    assert done == [
        ("PodReadyToStartContainers", False, ""),
        ("Initialized", True, "PodCompleted"),
        ("ContainersReady", False, "PodCompleted"),
        ("Ready", False, "PodCompleted"),
    ]


def test_conditions_keep_their_transition_time_until_the_status_changes() -> None:
    first = st.transition_time(None, False, "t0")
    assert first == ("False", "t0")
    assert st.transition_time(first, False, "t1") == ("False", "t0")
    assert st.transition_time(first, True, "t2") == ("True", "t2")
    assert st.condition("Ready", True, "", "t2") == {
        "type": "Ready",
        "status": "True",
        "lastProbeTime": None,
        "lastTransitionTime": "t2",
        "reason": None,
    }
