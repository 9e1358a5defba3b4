"""status.modeSwitch and condition ModeSwitch: each node's phase in a change of spec.mode from
its current agent Pod and the ProxyNodeState that Pod wrote, a summary, a stuck node named
with the agent's error and what to do - the pure parts, and the reconcile pass against an
in-memory apiserver."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from test_operator_reconciler import NS, Events, FakeApi, body, reconciler, run

from kpx_api.agentconfig import AgentConfiguration, parse_agent_config_text
from kpx_api.proxyconfiguration import (
    ModeSwitchNode,
    ModeSwitchPhase,
    ModeSwitchStatus,
    parse_spec,
)
from kpx_operator.builders import RESTART_HASH_ANNOTATION
from kpx_operator.mode_switch import (
    ROLLBACK_GRACE,
    condition,
    node_phases,
    pod_mode,
    rollback,
    stuck_after,
    switch_status,
    track,
)

P = ModeSwitchPhase
NOW = datetime(2026, 1, 1, tzinfo=UTC)
EPERM = (
    "mode nftables: sync failed, keeping the previous rules and retrying: nft: Operation "
    "not permitted"
)


def pod(uid: str, node: str, mode: str, started_ago: float = 5.0, **status: Any) -> dict[str, Any]:
    start = (NOW - timedelta(seconds=started_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"kpx-agent-default-{uid}",
            "uid": uid,
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/name": "kpx-agent",
                "app.kubernetes.io/instance": "default",
            },
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "agent", "command": ["proxy-agent", "--mode", mode, "--config", "f"]}
            ],
        },
        "status": {"startTime": start, **status},
    }


T1, T2 = "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z"
WAITING = "the rules of kpx mode iptables not removed yet"


def node_state(
    uid: str,
    node: str,
    *,
    verified: bool = False,
    error: str = "",
    rolled_back: str = "",
    pending: dict[str, str] | None = None,
    mode: str = "nftables",
) -> dict[str, Any]:
    """The ProxyNodeState of `node` as the agent Pod `uid` wrote it."""
    status: dict[str, Any] = {
        "mode": mode,
        "agentVersion": "0.1.0",
        "firstSyncVerified": verified,
        "rolledBack": rolled_back,
        "agentPod": {"name": f"kpx-agent-default-{uid}", "namespace": NS, "uid": uid},
        "leftoversPending": [
            {
                "name": n,
                "kind": "KpxMode",
                "message": m,
                "state": "Failing" if m.startswith("could not remove") else "Pending",
            }
            for n, m in (pending or {}).items()
        ],
    }
    if error:
        status["lastError"] = {"message": error, "time": T1}
    return {
        "apiVersion": "proxy.kpx.dev/v1alpha1",
        "kind": "ProxyNodeState",
        "metadata": {"name": node},
        "status": status,
    }


def put_states(api: FakeApi, *states: dict[str, Any]) -> None:
    for obj in states:
        api.objs[("ProxyNodeState", None, obj["metadata"]["name"])] = obj


def test_each_node_phase_from_its_current_agent() -> None:
    crash = {
        "containerStatuses": [
            {
                "name": "agent",
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
            }
        ]
    }
    pods = [
        pod("u1", "n1", "iptables"),  # the old mode's agent
        pod("u2", "n2", "nftables"),  # started 5 s ago, not verified yet
        pod("u3", "n3", "nftables"),  # verified, the iptables rules not removed yet
        pod("u4", "n4", "nftables"),  # verified, the iptables rules removed
        pod("u5", "n5", "nftables", started_ago=30),  # the kernel refuses its rules
        pod("u6", "n6", "nftables", started_ago=30, **crash),
        pod("u7", "n7", "nftables"),  # removed ipvs's rules only: not yet iptables's
    ]
    events = [
        node_state("u2", "n2", pending={"iptables": WAITING}),
        node_state(
            "u3",
            "n3",
            verified=True,
            pending={
                "iptables": "could not remove the rules of kpx mode iptables (retrying): lock"
            },
        ),
        node_state("u4", "n4", verified=True, pending={}),
        node_state("u5", "n5", error=EPERM, pending={"iptables": WAITING}),
        node_state("u7", "n7", verified=True, pending={"iptables": WAITING}),
        # Written by a Pod that is gone, or by an agent about another node: does not count.
        node_state("u-old", "n1", verified=True),
        node_state("u6", "n5", verified=True),
        {"metadata": {"name": "n6"}, "status": {"mode": "not-a-mode"}},  # unparsable
    ]
    phases = node_phases(pods, events, "iptables", "nftables", NOW)
    assert {n: p for n, (p, _) in phases.items()} == {
        "n1": P.PENDING,
        "n2": P.SWITCHING,
        "n3": P.SWITCHING,
        "n4": P.SWITCHED,
        "n5": P.STUCK,
        "n6": P.STUCK,
        "n7": P.SWITCHING,
    }
    assert phases["n1"][1] == "its agent runs mode iptables"
    assert "(retrying): lock" in phases["n3"][1]
    assert phases["n5"][1] == (
        f"its nftables agent has run 30s without a verified sync (not Ready): {EPERM}"
    )
    assert phases["n6"][1].endswith("container CrashLoopBackOff: back-off 40s")
    # The same Pods with a longer threshold: nobody is stuck yet.
    patient = node_phases(pods, events, "iptables", "nftables", NOW, stuck_after=60)
    assert patient["n5"][0] is P.SWITCHING


def test_pod_mode_reads_the_agent_command() -> None:
    assert pod_mode(pod("u", "n", "ipvs")) == "ipvs"
    assert pod_mode({"spec": {"containers": [{"name": "other", "command": ["--mode", "x"]}]}}) == ""


def test_a_switch_starts_when_the_mode_in_effect_differs_and_is_kept_until_the_next() -> None:
    assert track(None, None, "nftables", False, NOW) is None  # first deployment
    assert track(None, "nftables", "nftables", False, NOW) is None  # no switch ever
    assert track(None, "iptables", "nftables", True, NOW) is None  # held by preflight
    started = track(None, "iptables", "nftables", False, NOW)
    assert started is not None
    assert (started.from_mode, started.to_mode, started.started_at) == ("iptables", "nftables", NOW)
    # Applied: the ConfigMap says nftables from now on; the same switch is followed.
    later = NOW + timedelta(seconds=10)
    assert track(started, "nftables", "nftables", False, later) is started
    # The apply failed and is retried: still the same switch.
    assert track(started, "iptables", "nftables", False, later) is started
    # spec.mode set back mid-way: a new switch, from the mode in effect.
    back = track(started, "nftables", "iptables", False, later)
    assert back is not None and (back.from_mode, back.to_mode) == ("nftables", "iptables")
    assert back.started_at == later


def test_the_summary_counts_phases_and_the_end_is_stamped() -> None:
    switch = ModeSwitchStatus(from_mode="iptables", to_mode="nftables", started_at=NOW)
    later = NOW + timedelta(seconds=42)
    running = switch_status(
        switch,
        {"a": (P.SWITCHED, ""), "b": (P.STUCK, "why"), "c": (P.PENDING, "")},
        ["a", "b", "c"],
        later,
    )
    assert running.summary == "1 of 3 nodes switched from iptables to nftables (1 Stuck, 1 Pending)"
    assert running.switched == 1 and running.finished_at is None
    assert [n.name for n in running.nodes] == ["a", "b", "c"]
    # b's agent is being replaced (no Pod now): Pending; a's restarts: it stays Switched; a
    # node that left the cluster is dropped.
    between = switch_status(running, {"c": (P.SWITCHED, "")}, ["a", "b", "c"], later)
    assert {n.name: n.phase for n in between.nodes} == {
        "a": P.SWITCHED,
        "b": P.PENDING,
        "c": P.SWITCHED,
    }
    assert switch_status(running, {}, ["a"], later).nodes == [
        ModeSwitchNode(name="a", phase=P.SWITCHED, message="")
    ]
    done = switch_status(running, {n: (P.SWITCHED, "") for n in "abc"}, ["a", "b", "c"], later)
    assert done.finished_at == later
    assert done.summary == "3 of 3 nodes switched from iptables to nftables in 42s"
    assert condition(done) == ("True", "Switched", done.summary)
    # A finished switch stays as it is.
    assert switch_status(done, {"a": (P.STUCK, "")}, ["a"], later) is done
    # No agent at all is no finished switch.
    assert switch_status(switch, {}, [], later).finished_at is None


def test_a_stuck_node_is_named_with_the_agents_error_and_what_to_do() -> None:
    switch = ModeSwitchStatus(from_mode="iptables", to_mode="nftables", started_at=NOW)
    status = switch_status(switch, {"a": (P.SWITCHED, ""), "b": (P.STUCK, EPERM)}, "ab", NOW)
    state, reason, message = condition(status)
    assert (state, reason) == ("False", "NodeStuck")
    assert message.startswith(f"the switch to mode nftables is stuck on node b: {EPERM}.")
    assert "keeps serving on its iptables rules" in message
    assert "set spec.mode back to iptables" in message
    assert condition(switch_status(switch, {"a": (P.SWITCHING, "")}, "a", NOW))[1] == "Switching"


def test_reconcile_follows_a_switch_warns_once_about_a_stuck_node_and_reports_the_end() -> None:
    api, events = FakeApi(), Events()
    r = reconciler(api)
    ipt = body(mode="iptables", iptables={"syncPeriod": "30s"}, generation=1)
    del ipt["spec"]["nftables"]
    status = run(r.reconcile(ipt, [], {"a": {}, "b": {}}, events))
    assert status.mode_switch is None and status.condition("ModeSwitch") is None
    for uid, node in (("a1", "a"), ("b1", "b")):
        api.objs[("Pod", NS, uid)] = pod(uid, node, "iptables")
    nodes: dict[str, dict[str, str]] = {"a": {}, "b": {}}

    # Without rollback: a node that cannot program is Stuck after the deadline (30 s).
    nft = body(generation=2, modeSwitch={"rollbackOnFailure": False})
    status = run(r.reconcile(nft, [], nodes, events))
    switch = status.mode_switch
    assert switch is not None and (switch.from_mode, switch.to_mode) == ("iptables", "nftables")
    assert {n.name: n.phase for n in switch.nodes} == {"a": P.PENDING, "b": P.PENDING}
    assert switch.summary == "0 of 2 nodes switched from iptables to nftables (2 Pending)"
    assert status.condition("ModeSwitch").reason == "Switching"

    # a switched; b's new agent cannot program its kernel.
    del api.objs[("Pod", NS, "a1")], api.objs[("Pod", NS, "b1")]
    api.objs[("Pod", NS, "a2")] = pod("a2", "a", "nftables")
    api.objs[("Pod", NS, "b2")] = pod("b2", "b", "nftables", started_ago=30)
    put_states(api, node_state("a2", "a", verified=True), node_state("b2", "b", error=EPERM))
    for _ in range(2):
        status = run(r.reconcile(nft, [], nodes, events))
    switch = status.mode_switch
    assert {n.name: n.phase for n in switch.nodes} == {"a": P.SWITCHED, "b": P.STUCK}
    assert switch.summary == "1 of 2 nodes switched from iptables to nftables (1 Stuck)"
    cond = status.condition("ModeSwitch")
    assert (cond.status, cond.reason) == ("False", "NodeStuck")
    assert "stuck on node b" in cond.message and "Operation not permitted" in cond.message
    warnings = [m for t, r_, m in events if r_ == "ModeSwitchStuck"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "the switch to mode nftables is stuck on node b: its nftables agent"
    )
    assert api.statuses[-1]["modeSwitch"]["nodes"][1]["phase"] == "Stuck"

    # The node is fixed: its agent verifies and removes the iptables rules.
    put_states(api, node_state("b2", "b", verified=True, error=EPERM))
    status = run(r.reconcile(nft, [], nodes, events))
    switch = status.mode_switch
    assert switch.finished_at is not None and switch.switched == 2
    assert switch.summary == "2 of 2 nodes switched from iptables to nftables in 0s"
    assert status.condition("ModeSwitch").status == "True"
    run(r.reconcile(nft, [], nodes, events))
    assert events.reasons().count("ModeSwitchFinished") == 1
    assert events.reasons().count("ModeSwitchStuck") == 1


def test_setting_the_mode_back_mid_switch_starts_a_switch_back() -> None:
    api, events = FakeApi(), Events()
    r = reconciler(api)
    ipt = body(mode="iptables", iptables={"syncPeriod": "30s"}, generation=1)
    del ipt["spec"]["nftables"]
    run(r.reconcile(ipt, [], {}, events))
    api.objs[("Pod", NS, "b2")] = pod("b2", "b", "nftables", started_ago=30)
    nft = body(generation=2, modeSwitch={"rollbackOnFailure": False})
    status = run(r.reconcile(nft, [], {"b": {}}, events))
    assert status.mode_switch.nodes[0].phase is P.STUCK
    back = dict(ipt, metadata={**ipt["metadata"], "generation": 3})
    status = run(r.reconcile(back, [], {"b": {}}, events))
    switch = status.mode_switch
    assert (switch.from_mode, switch.to_mode) == ("nftables", "iptables")
    # b still runs the nftables agent (the DaemonSet replaces it next): Pending.
    assert switch.nodes[0].phase is P.PENDING


ROLLED_BACK = (
    "nftables never synced within 30s: nft: Operation not permitted; serving with iptables again"
)


def test_a_node_whose_agent_rolled_back_is_named_with_its_reason_and_what_to_do() -> None:
    pods = [pod(u, n, "nftables", started_ago=40) for u, n in (("u1", "n1"), ("u2", "n2"))]
    events = [
        node_state(
            "u1", "n1", error=EPERM, rolled_back=ROLLED_BACK, verified=True, mode="iptables"
        ),
        node_state("u2", "n2", error=EPERM),  # past the deadline, not rolled back
    ]
    phases = node_phases(pods, events, "iptables", "nftables", NOW, stuck_after=45)
    assert phases["n1"][0] is P.ROLLED_BACK
    assert phases["n1"][1].startswith(ROLLED_BACK + ". Its agent stays not Ready")
    assert "delete its agent Pod" in phases["n1"][1]
    assert "set spec.mode back to iptables" in phases["n1"][1]
    # Within the grace the agent gets to roll back by itself: not Stuck yet.
    assert phases["n2"][0] is P.SWITCHING
    assert node_phases(pods, events, "iptables", "nftables", NOW, stuck_after=30)["n2"][0] is (
        P.STUCK
    )
    switch = ModeSwitchStatus(from_mode="iptables", to_mode="nftables", started_at=NOW)
    status = switch_status(
        switch, {"a": (P.SWITCHED, ""), "b": phases["n1"], "c": (P.PENDING, "")}, "abc", NOW
    )
    assert status.summary == (
        "1 of 3 nodes switched from iptables to nftables (1 RolledBack, 1 Pending)"
    )
    assert status.nodes[1].phase is P.ROLLED_BACK and status.finished_at is None
    state, reason, message = condition(status)
    assert (state, reason) == ("False", "NodeRolledBack")
    assert message.startswith(
        f"the switch to mode nftables failed on node b, which went back to iptables: {ROLLED_BACK}"
    )


def test_the_deadline_and_the_grace_come_from_the_spec() -> None:
    spec = parse_spec({"mode": "nftables", "modeSwitch": {"progressDeadlineSeconds": 10}})
    assert stuck_after(spec) == 10 + ROLLBACK_GRACE
    off = parse_spec(
        {
            "mode": "nftables",
            "modeSwitch": {"progressDeadlineSeconds": 10, "rollbackOnFailure": False},
        }
    )
    assert stuck_after(off) == 10


def _config(mode: str, **block: Any) -> AgentConfiguration:
    return AgentConfiguration.model_validate({"mode": mode, mode: block})


def test_the_rollback_block_carries_the_old_modes_settings_in_effect_during_the_switch() -> None:
    spec = parse_spec({"mode": "nftables", "modeSwitch": {"progressDeadlineSeconds": 12}})
    switch = ModeSwitchStatus(from_mode="iptables", to_mode="nftables", started_at=NOW)
    before = _config("iptables", masqueradeBit=9, localhostNodePorts=False)
    back = rollback(spec, switch, before)
    assert back is not None and back.to_dict() == {
        "mode": "iptables",
        "enabled": True,
        "progressDeadlineSeconds": 12,
        "iptables": {
            "masqueradeBit": 9,
            "masqueradeAll": False,
            "localhostNodePorts": False,
            "syncPeriod": "30s",
            "minSyncPeriod": "1s",
        },
    }
    # The next pass reads the ConfigMap it wrote (mode nftables): the same block, from there.
    applied = AgentConfiguration.model_validate({"mode": "nftables", "rollback": back.to_dict()})
    assert rollback(spec, switch, applied) == back
    # Nothing known of the old mode: its defaults.
    fresh = rollback(spec, switch, None)
    assert fresh is not None and fresh.iptables is not None and fresh.iptables.masquerade_bit == 14
    # No rollback: no switch, a finished one, rollbackOnFailure false, an external mode.
    assert rollback(spec, None, before) is None
    assert rollback(spec, switch.model_copy(update={"finished_at": NOW}), before) is None
    # rollbackOnFailure false: the block still names the old mode (readiness waits for its
    # rules' removal), not enabled.
    off = parse_spec({"mode": "nftables", "modeSwitch": {"rollbackOnFailure": False}})
    named = rollback(off, switch, before)
    assert named is not None and (named.mode, named.enabled) == ("iptables", False)
    ext = ModeSwitchStatus(from_mode="external", to_mode="nftables", started_at=NOW)
    assert rollback(spec, ext, None) is None
    # The switch is to another mode than the spec's (the spec changed again): none.
    other = ModeSwitchStatus(from_mode="nftables", to_mode="iptables", started_at=NOW)
    assert rollback(spec, other, before) is None
    # From ipvs: its block, accepted as it ran.
    ipvs = ModeSwitchStatus(from_mode="ipvs", to_mode="nftables", started_at=NOW)
    got = rollback(spec, ipvs, _config("ipvs", acknowledgeDeprecation=True, scheduler="lc"))
    assert got is not None and got.ipvs is not None and str(got.ipvs.scheduler) == "lc"
    rolled = AgentConfiguration.model_validate({"mode": "nftables", "rollback": got.to_dict()})
    assert rolled.rollback_config() is not None


def _agent_config(api: Any) -> AgentConfiguration:
    cm = api.objs[("ConfigMap", NS, "kpx-agent-default")]
    return parse_agent_config_text(cm["data"]["config.yaml"])


def _template_hash(api: Any) -> str:
    ds = api.objs[("DaemonSet", NS, "kpx-agent-default")]
    return str(ds["spec"]["template"]["metadata"]["annotations"][RESTART_HASH_ANNOTATION])


def test_reconcile_renders_the_rollback_while_the_switch_runs_without_rolling_agents_twice() -> (
    None
):
    api, events = FakeApi(), Events()
    r = reconciler(api)
    ipt = body(mode="iptables", iptables={"syncPeriod": "30s", "masqueradeBit": 10}, generation=1)
    del ipt["spec"]["nftables"]
    run(r.reconcile(ipt, [], {"a": {}}, events))
    assert _agent_config(api).rollback is None
    old_hash = _template_hash(api)
    api.objs[("Pod", NS, "a1")] = pod("a1", "a", "iptables")

    nft = body(generation=2, modeSwitch={"progressDeadlineSeconds": 10})
    run(r.reconcile(nft, [], {"a": {}}, events))
    during = _agent_config(api)
    assert during.mode == "nftables" and during.rollback is not None
    assert (during.rollback.mode, during.rollback.progress_deadline_seconds) == ("iptables", 10)
    assert during.rollback.iptables is not None and during.rollback.iptables.masquerade_bit == 10
    switching_hash = _template_hash(api)
    assert switching_hash != old_hash  # the mode changed: the agents roll
    # The next pass keeps it (from the ConfigMap it wrote).
    run(r.reconcile(nft, [], {"a": {}}, events))
    assert _agent_config(api).rollback == during.rollback

    # a's agent rolled back: the switch goes on (not finished), the rollback stays, and the
    # ProxyConfiguration gets one Warning.
    del api.objs[("Pod", NS, "a1")]
    api.objs[("Pod", NS, "a2")] = pod("a2", "a", "nftables", started_ago=12)
    put_states(api, node_state("a2", "a", rolled_back=ROLLED_BACK, mode="iptables"))
    for _ in range(2):
        status = run(r.reconcile(nft, [], {"a": {}}, events))
    assert status.mode_switch.nodes[0].phase is P.ROLLED_BACK
    cond = status.condition("ModeSwitch")
    assert (cond.status, cond.reason) == ("False", "NodeRolledBack")
    warned = [m for _, reason, m in events if reason == "ModeSwitchRolledBack"]
    assert len(warned) == 1 and warned[0].startswith(
        f"node a went back to mode iptables: {ROLLED_BACK}"
    )
    assert _agent_config(api).rollback is not None

    # The node is fixed and its Pod deleted: the new agent switches; once the switch finished,
    # the next pass drops the rollback without changing the pod template.
    del api.objs[("Pod", NS, "a2")]
    api.objs[("Pod", NS, "a3")] = pod("a3", "a", "nftables")
    put_states(api, node_state("a3", "a", verified=True))
    status = run(r.reconcile(nft, [], {"a": {}}, events))
    assert status.mode_switch.finished_at is not None
    run(r.reconcile(nft, [], {"a": {}}, events))
    assert _agent_config(api).rollback is None
    assert _template_hash(api) == switching_hash
