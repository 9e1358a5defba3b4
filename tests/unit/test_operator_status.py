"""Status computation: one row per situation, and lastTransitionTime stability."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from kpx_api import ProxyConfigurationStatus
from kpx_operator.admission import Admission, Overlap
from kpx_operator.status import Observed, Rollout, compute_status, is_current, status_patch

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)
GEN = 3

DEPLOY = Admission(deploy=True)
DENIED = Admission(deploy=False, deprecated=True, ipvs_denied=True)
NO_BACKEND = Admission(deploy=False, deprecated=True, no_backend=True)
#: Every node of this one is selected by an older configuration too: its agents stay off them.
BLOCKED = Admission(deploy=True, overlaps=(Overlap("older", ("node-1", "node-2"), True),))
#: Two of its three nodes are contested: its agents keep running on the third.
PARTLY = Admission(deploy=True, overlaps=(Overlap("older", ("node-1",), True),))
WINNER = Admission(deploy=True, overlaps=(Overlap("newer", ("node-1",), False),))


def ds(
    desired: int, updated: int, ready: int, *, generation: int = 7, observed: int | None = 7
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "desiredNumberScheduled": desired,
        "updatedNumberScheduled": updated,
        "numberReady": ready,
        "currentNumberScheduled": desired,
    }
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "status": status}


@dataclass(frozen=True)
class Row:
    observed: Observed
    conditions: dict[str, tuple[str, str]]  # type -> (status, reason)
    desired: int
    ready: int
    mode: str | None
    in_message: dict[str, str] = field(default_factory=dict)  # type -> text in its message


def obs(
    adm: Admission = DEPLOY, daemonset: Any = None, mode: str = "nftables", **kw: Any
) -> Observed:
    return Observed(GEN, mode, adm, daemonset, **kw)


SUPPORTED = ("False", "ModeSupported")
FINE = ("False", "AsExpected")
#: kstatus' conditions: nothing left to do; agents rolling out; a person must act.
DONE = {"Reconciling": ("False", "Reconciled"), "Stalled": FINE}
ROLLING = {"Reconciling": ("True", "RollingOut"), "Stalled": FINE}


def stalled(reason: str) -> dict[str, tuple[str, str]]:
    return {"Reconciling": ("False", "Stalled"), "Stalled": ("True", reason)}


ROWS = {
    "all agents ready": Row(
        obs(daemonset=ds(3, 3, 3)),
        {
            "Ready": ("True", "AllAgentsReady"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **DONE,
        },
        desired=3,
        ready=3,
        mode="nftables",
    ),
    "rolling out: one node updated": Row(
        obs(daemonset=ds(3, 1, 3)),
        {
            "Ready": ("False", "AgentsNotReady"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **ROLLING,
        },
        desired=3,
        ready=1,
        mode="nftables",
        in_message={"Progressing": "1 of 3 nodes"},
    ),
    "updated but not ready yet": Row(
        obs(daemonset=ds(3, 3, 1)),
        {
            "Ready": ("False", "AgentsNotReady"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **ROLLING,
        },
        desired=3,
        ready=1,
        mode="nftables",
    ),
    "template not observed by the DaemonSet controller": Row(
        obs(daemonset=ds(3, 3, 3, generation=8, observed=7)),
        {
            "Ready": ("False", "RollingOut"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **ROLLING,
        },
        desired=0,
        ready=0,
        mode="nftables",
    ),
    "fresh DaemonSet without status": Row(
        obs(daemonset={"metadata": {"generation": 1}}),
        {
            "Ready": ("False", "RollingOut"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **ROLLING,
        },
        desired=0,
        ready=0,
        mode="nftables",
    ),
    "DaemonSet missing": Row(
        obs(daemonset=None),
        {
            "Ready": ("False", "AgentsNotDeployed"),
            "Progressing": ("True", "RollingOut"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **ROLLING,
        },
        desired=0,
        ready=0,
        mode="nftables",
    ),
    "no node selected": Row(
        obs(daemonset=ds(0, 0, 0)),
        {
            "Ready": ("False", "NoMatchingNodes"),
            "Progressing": ("False", "NoMatchingNodes"),
            "Degraded": FINE,
            "Deprecated": SUPPORTED,
            **DONE,
        },
        desired=0,
        ready=0,
        mode="nftables",
    ),
    "ipvs allowed": Row(
        obs(Admission(deploy=True, deprecated=True), ds(2, 2, 2), mode="ipvs"),
        {
            "Ready": ("True", "AllAgentsReady"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": FINE,
            "Deprecated": ("True", "IPVSDeprecated"),
            **DONE,
        },
        desired=2,
        ready=2,
        mode="ipvs",
        in_message={"Deprecated": "nftables"},
    ),
    "ipvs denied": Row(
        obs(DENIED, None, mode="ipvs"),
        {
            "Ready": ("False", "IPVSDenied"),
            "Progressing": ("False", "IPVSDenied"),
            "Degraded": ("True", "IPVSDenied"),
            "Deprecated": ("True", "IPVSDeprecated"),
            **stalled("IPVSDenied"),
        },
        desired=0,
        ready=0,
        mode=None,
        in_message={"Degraded": "nftables", "Ready": "--ipvs-policy=deny"},
    ),
    "mode without a backend in the agent": Row(
        obs(NO_BACKEND, None, mode="ipvs"),
        {
            "Ready": ("False", "ModeNotImplemented"),
            "Progressing": ("False", "ModeNotImplemented"),
            "Degraded": ("True", "ModeNotImplemented"),
            "Deprecated": ("True", "IPVSDeprecated"),
            **stalled("ModeNotImplemented"),
        },
        desired=0,
        ready=0,
        mode=None,
        in_message={"Degraded": "mode ipvs has no backend", "Ready": "nothing is deployed"},
    ),
    "every node kept by an older configuration": Row(
        obs(BLOCKED, ds(0, 0, 0)),
        {
            "Ready": ("False", "NoMatchingNodes"),
            "Progressing": ("False", "NoMatchingNodes"),
            "Degraded": ("True", "NodeConflict"),
            "Deprecated": SUPPORTED,
            **stalled("NodeConflict"),
        },
        desired=0,
        ready=0,
        mode="nftables",
        in_message={
            "Degraded": "keeps its agents off nodes node-1, node-2",
            "Ready": "older ProxyConfigurations run there",
        },
    ),
    "newer side of a conflict keeps its other nodes": Row(
        obs(PARTLY, ds(2, 2, 2)),
        {
            "Ready": ("True", "AllAgentsReady"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": ("True", "NodeConflict"),
            "Deprecated": SUPPORTED,
            **stalled("NodeConflict"),
        },
        desired=2,
        ready=2,
        mode="nftables",
        in_message={"Degraded": "keeps its agents off node node-1 until"},
    ),
    "older side of a conflict keeps running": Row(
        obs(WINNER, ds(2, 2, 2)),
        {
            "Ready": ("True", "AllAgentsReady"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": ("True", "NodeConflict"),
            "Deprecated": SUPPORTED,
            **DONE,
        },
        desired=2,
        ready=2,
        mode="nftables",
        in_message={"Degraded": "node-1 is also selected by ProxyConfiguration newer"},
    ),
    "apply refused": Row(
        obs(daemonset=ds(2, 2, 2), error="Forbidden (403): daemonsets is forbidden"),
        {
            "Ready": ("True", "AllAgentsReady"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": ("True", "ReconcileFailed"),
            "Deprecated": SUPPORTED,
            "Reconciling": ("True", "ReconcileFailed"),
            "Stalled": FINE,
        },
        desired=2,
        ready=2,
        mode="nftables",
        in_message={"Degraded": "Forbidden"},
    ),
    "invalid spec": Row(
        obs(Admission(deploy=False), None, invalid="spec: mode: required"),
        {
            "Ready": ("False", "InvalidSpec"),
            "Progressing": ("False", "InvalidSpec"),
            "Degraded": ("True", "InvalidSpec"),
            "Deprecated": SUPPORTED,
            **stalled("InvalidSpec"),
        },
        desired=0,
        ready=0,
        mode=None,
    ),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_status_row(name: str) -> None:
    row = ROWS[name]
    status = compute_status(row.observed, None, T0)
    got = {c.type: (str(c.status), c.reason) for c in status.conditions}
    assert got == row.conditions
    assert [c.type for c in status.conditions] == [
        "Ready",
        "Progressing",
        "Degraded",
        "Deprecated",
        "Reconciling",
        "Stalled",
    ]
    assert (status.desired_nodes, status.ready_nodes) == (row.desired, row.ready)
    assert status.mode == row.mode
    assert status.observed_generation == GEN
    assert status.deprecated is (row.observed.mode == "ipvs")
    for cond in status.conditions:
        assert cond.observed_generation == GEN
        assert cond.last_transition_time == T0
        assert cond.message
    for type_, text in row.in_message.items():
        assert text in next(c.message for c in status.conditions if c.type == type_)
    # What is written validates against the API model (as the apiserver's schema would).
    ProxyConfigurationStatus.model_validate(status_patch(status))


def test_transition_time_moves_only_when_the_status_flips() -> None:
    rolling = obs(daemonset=ds(3, 1, 1))
    first = compute_status(rolling, None, T0)
    again = compute_status(replace(rolling, daemonset=ds(3, 2, 2)), first, T1)
    assert [c.last_transition_time for c in again.conditions] == [T0] * 6
    # The reason and message may change without a transition.
    assert again.condition("Progressing").message != first.condition("Progressing").message  # type: ignore[union-attr]
    done = compute_status(replace(rolling, daemonset=ds(3, 3, 3)), again, T1)
    times = {c.type: c.last_transition_time for c in done.conditions}
    assert times == {
        "Ready": T1,
        "Progressing": T1,
        "Degraded": T0,
        "Deprecated": T0,
        "Reconciling": T1,
        "Stalled": T0,
    }


def test_rollout_counts_only_current_and_updated_pods_as_ready() -> None:
    assert Rollout.from_daemonset(ds(4, 4, 4)).ready_current == 4
    assert (
        Rollout.from_daemonset(ds(4, 1, 4)).ready_current == 1
    )  # 3 old pods may be the ready ones
    assert Rollout.from_daemonset(ds(4, 2, 2)).ready_current == 0  # both ready pods may be old
    assert Rollout.from_daemonset(ds(4, 4, 4, generation=2, observed=1)).ready_current == 0
    assert not Rollout.from_daemonset(ds(4, 4, 4, generation=2, observed=1)).complete


def test_stored_status_with_kopf_storage_is_current() -> None:
    status = compute_status(obs(daemonset=ds(1, 1, 1)), None, T0)
    stored = {**status_patch(status), "kopf": {"progress": {}}}
    stored = {k: v for k, v in stored.items() if v is not None}
    assert is_current(stored, status)
    stored["readyNodes"] = 0
    assert not is_current(stored, status)
    assert not is_current(None, status)


def test_patch_removes_the_mode_when_nothing_runs() -> None:
    status = compute_status(obs(DENIED, None, mode="ipvs"), None, T0)
    patch = status_patch(status)
    assert patch["mode"] is None  # JSON merge patch: null removes the field
    assert "kopf" not in patch
    assert patch["conditions"][0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"


def test_agents_reporting_conntrack_not_applied_make_it_degraded_not_unready() -> None:
    from kpx_operator.agent_reports import NodeProblem

    problems = (NodeProblem("n1", "nf_conntrack_max: cannot set"), NodeProblem("n2", "x"))
    status = compute_status(obs(daemonset=ds(2, 2, 2), conntrack_problems=problems), None, T0)
    degraded = status.condition("Degraded")
    assert (degraded.status, degraded.reason) == ("True", "ConntrackNotApplied")
    assert degraded.message.startswith("spec.conntrack is not applied on nodes n1, n2:")
    assert status.condition("Ready").status == "True"
    # A refused apply says more about the configuration: it wins.
    failed = obs(daemonset=ds(2, 2, 2), conntrack_problems=problems, error="Forbidden (403)")
    assert compute_status(failed, None, T0).condition("Degraded").reason == "ReconcileFailed"


def kstatus_of(status: ProxyConfigurationStatus) -> dict[str, tuple[str, str]]:
    return {
        c.type: (str(c.status), c.reason)
        for c in status.conditions
        if c.type in ("Reconciling", "Stalled")
    }


def test_a_rollout_past_its_deadline_is_stalled_until_it_completes() -> None:
    rolling = obs(daemonset=ds(2, 2, 1), rollout_deadline=60)
    first = compute_status(rolling, None, T0)
    assert kstatus_of(first) == ROLLING
    within = compute_status(rolling, first, T0 + timedelta(seconds=60))
    assert kstatus_of(within) == ROLLING
    late = compute_status(rolling, within, T0 + timedelta(seconds=61))
    assert kstatus_of(late) == stalled("RolloutDeadlineExceeded")
    assert "no progress for 60s: 2 of 2 nodes run the current agent, 1 agents ready" in (
        late.condition("Stalled").message  # type: ignore[union-attr]
    )
    done = compute_status(replace(rolling, daemonset=ds(2, 2, 2)), late, T1)
    assert kstatus_of(done) == DONE
    # A rollout that makes progress (a node more ready, as the reconciler tracks it) restarts
    # the deadline, as a Deployment's does: a long rollout over many nodes is not Stalled.
    moving = replace(rolling, last_progress=T0 + timedelta(seconds=50))
    assert kstatus_of(compute_status(moving, within, T0 + timedelta(seconds=61))) == ROLLING
    assert kstatus_of(compute_status(moving, within, T0 + timedelta(seconds=111))) == stalled(
        "RolloutDeadlineExceeded"
    )
    # No deadline: Reconciling for as long as it takes.
    endless = replace(rolling, rollout_deadline=None)
    assert kstatus_of(compute_status(endless, first, T1 + timedelta(days=1))) == ROLLING


def test_kstatus_conditions_from_preflight_and_mode_switch() -> None:
    from kpx_operator.status import kstatus_conditions

    base = [
        ("Ready", "True", "AllAgentsReady", "2 of 2"),
        ("Progressing", "False", "RolloutComplete", "2 of 2"),
        ("Degraded", "False", "AsExpected", "no known problem"),
    ]

    def k(*extra: tuple[str, str, str, str]) -> dict[str, tuple[str, str]]:
        got = kstatus_conditions([*base, *extra], None, T0, 60)  # type: ignore[list-item]
        return {t: (s, r) for t, s, r, _ in got}

    assert k() == DONE
    held = ("Preflight", "False", "SettingsNotCarriedOver", "set spec.modeSwitch.acceptDropped")
    assert k(held) == stalled("SettingsNotCarriedOver")
    assert k(("Preflight", "True", "ModeCanRun", "every node")) == DONE
    assert k(("ModeSwitch", "False", "Switching", "1 of 2")) == {
        "Reconciling": ("True", "ModeSwitching"),
        "Stalled": FINE,
    }
    assert k(("ModeSwitch", "False", "NodeStuck", "stuck")) == stalled("NodeStuck")
    assert k(("ModeSwitch", "False", "NodeRolledBack", "back")) == stalled("NodeRolledBack")
    assert k(("ModeSwitch", "True", "Switched", "done")) == DONE
    conntrack = ("Degraded", "True", "ConntrackNotApplied", "node-1: read-only")
    got = kstatus_conditions([*base[:2], conntrack], None, T0, 60)  # type: ignore[list-item]
    assert {t: (s, r) for t, s, r, _ in got} == stalled("ConntrackNotApplied")
    assert next(m for t, _, _, m in got if t == "Stalled") == "node-1: read-only"


def test_the_crds_default_status_is_not_the_operators() -> None:
    """Until the operator writes, the apiserver shows the CRD's default status (Reconciling
    True, NotYetSeen): the operator's first pass treats it as no status at all."""
    from kpx_api.proxyconfiguration import UNSEEN_CONDITIONS
    from kpx_operator.status import parse_status

    unseen = {"conditions": [dict(c) for c in UNSEEN_CONDITIONS]}
    assert parse_status(unseen) is None
    assert parse_status({**unseen, "kopf": {"last-handled-digest": "sha256:0"}}) is None
    written = compute_status(obs(daemonset=ds(1, 1, 1)), None, T0)
    assert parse_status(status_patch(written)) == written
