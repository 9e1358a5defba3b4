"""Condition Preflight: which nodes cannot run spec.mode (status.preflight of the
ProxyNodeStates the current agents wrote),
and a mode switch held until the settings it drops are accepted (spec.modeSwitch)."""

from __future__ import annotations

from typing import Any

from test_operator_reconciler import (
    NS,
    Events,
    FakeApi,
    agent_pod,
    body,
    reconciler,
    run,
)

from kpx_api.preflight import Dropped, DroppedSetting, ModeCheck
from kpx_operator.preflight import assess, condition, preflight_reports

OK_ALL = [
    ("nftables", True, "nftables v1.0.6, kernel 6.1.0"),
    ("iptables", True, ""),
    ("ipvs", True, "ip_vs loaded"),
]
NO_IPVS = [
    ("nftables", True, "nftables v1.0.6"),
    ("iptables", True, ""),
    ("ipvs", False, "ip_vs is not a module of 6.1"),
]


def state(uid: str, node: str, verdicts: list[tuple[str, bool, str]]) -> dict[str, Any]:
    """The ProxyNodeState of `node` as agent Pod `uid` wrote it."""
    return {
        "metadata": {"name": node},
        "status": {
            "mode": "nftables",
            "agentPod": {"name": f"p-{uid}", "uid": uid},
            "preflight": [{"mode": m, "ok": ok, "detail": d} for m, ok, d in verdicts],
        },
    }


def test_reports_are_the_current_agent_pods_node_states() -> None:
    pods = [agent_pod("u1", "n1"), agent_pod("u2", "n2"), agent_pod("u3", "n3")]
    states = [
        state("u1", "n1", NO_IPVS),
        state("u2", "n2", OK_ALL),
        state("u3", "n3", []),  # not checked yet: not a report
        state("u-gone", "n3", NO_IPVS),  # written by a Pod that is gone
    ]
    reports = preflight_reports(pods, states)
    assert {n: r["ipvs"].ok for n, r in reports.items()} == {"n1": False, "n2": True}
    pf = assess("ipvs", reports)
    assert pf.unable == (("n1", "ip_vs is not a module of 6.1"),)
    why = "mode ipvs cannot run on node n1: ip_vs is not a module of 6.1"
    assert condition(pf) == ("False", "NodesCannotRunMode", why)
    assert condition(assess("nftables", reports)) == (
        "True",
        "ModeCanRun",
        "every node that reported (2) can run mode nftables",
    )
    assert condition(assess("nftables", {})) is None  # nobody reported: nothing to say


def test_dropped_settings_hold_until_accepted() -> None:
    dropped = [
        Dropped(DroppedSetting.IPVS_SCHEDULER, "ipvs.scheduler lc: ..."),
        Dropped(DroppedSetting.IPVS_TIMEOUTS, "ipvs udpTimeout=30s: ..."),
    ]
    ok = {"n1": {"nftables": ModeCheck("nftables", True)}}
    pf = assess("nftables", ok, dropped, [DroppedSetting.IPVS_SCHEDULER], from_mode="ipvs")
    assert [d.setting for d in pf.held] == [DroppedSetting.IPVS_TIMEOUTS]
    status, reason, message = condition(pf) or ("", "", "")
    assert (status, reason) == ("False", "SettingsNotCarriedOver")
    assert "spec.modeSwitch.acceptDropped: [ipvsTimeouts]" in message
    accepted = assess("nftables", ok, dropped, list(DroppedSetting), from_mode="ipvs")
    assert accepted.held == () and condition(accepted) == (
        "True",
        "ModeCanRun",
        "every node that reported (1) can run mode nftables",
    )


IPVS = {"acknowledgeDeprecation": True, "scheduler": "lc"}


def ipvs_body(**spec: Any) -> dict[str, Any]:
    doc = body(mode="ipvs", ipvs=IPVS, **spec)
    del doc["spec"]["nftables"]
    return doc


def test_a_switch_that_drops_a_setting_waits_for_the_acceptance() -> None:
    api, events = FakeApi(), Events()
    r = reconciler(api)
    run(r.reconcile(ipvs_body(), [], {}, events))
    cm = api.objs[("ConfigMap", NS, "kpx-agent-default")]
    assert "mode: ipvs" in cm["data"]["config.yaml"]
    # spec.mode -> nftables: the scheduler lc has no counterpart; nothing new is applied.
    switched = body(generation=2)
    status = run(r.reconcile(switched, [], {}, events))
    assert "mode: ipvs" in api.objs[("ConfigMap", NS, "kpx-agent-default")]["data"]["config.yaml"]
    pre = status.condition("Preflight")
    assert (pre.status, pre.reason) == ("False", "SettingsNotCarriedOver")
    assert "acceptDropped: [ipvsScheduler]" in pre.message and "ipvs.scheduler lc" in pre.message
    assert events.reasons().count("ModeSwitchHeld") == 1
    run(r.reconcile(switched, [], {}, events))
    assert events.reasons().count("ModeSwitchHeld") == 1  # said once per generation
    # Accepted: the switch proceeds.
    accepted = body(generation=3, modeSwitch={"acceptDropped": ["ipvsScheduler"]})
    status = run(r.reconcile(accepted, [], {}, events))
    assert (
        "mode: nftables" in api.objs[("ConfigMap", NS, "kpx-agent-default")]["data"]["config.yaml"]
    )
    assert status.condition("Preflight") is None  # no agent reported, nothing held


def test_nodes_that_cannot_run_the_mode_are_named() -> None:
    api, events = FakeApi(), Events()
    api.objs[("Pod", NS, "u1")] = agent_pod("u1", "n1")
    api.objs[("ProxyNodeState", None, "n1")] = state("u1", "n1", NO_IPVS)
    status = run(reconciler(api).reconcile(ipvs_body(), [], {}, events))
    pre = status.condition("Preflight")
    assert (pre.status, pre.reason) == ("False", "NodesCannotRunMode")
    assert pre.message == "mode ipvs cannot run on node n1: ip_vs is not a module of 6.1"


def iptables_body(**spec: Any) -> dict[str, Any]:
    """The default example in mode iptables (localhostNodePorts on by default) with
    nodePortAddresses empty: localhost NodePorts in effect."""
    doc = body(mode="iptables", iptables={}, nodePortAddresses=[], **spec)
    del doc["spec"]["nftables"]
    return doc


def nftables_body(generation: int, **nftables: Any) -> dict[str, Any]:
    return body(generation=generation, nodePortAddresses=[], nftables=nftables)


def test_a_switch_from_iptables_carries_localhost_node_ports_over_when_set() -> None:
    """iptables -> nftables: held (SettingsNotCarriedOver, naming the nftables setting) while
    the new spec leaves nftables.localhostNodePorts off; applied with it on, with nothing
    accepted, and the new agents get the route_localnet file."""
    api, events = FakeApi(), Events()
    r = reconciler(api)
    run(r.reconcile(iptables_body(), [], {}, events))
    config = lambda: api.objs[("ConfigMap", NS, "kpx-agent-default")]["data"]["config.yaml"]  # noqa: E731
    assert "mode: iptables" in config()
    status = run(r.reconcile(nftables_body(2, syncPeriod="30s"), [], {}, events))
    assert "mode: iptables" in config()  # held
    pre = status.condition("Preflight")
    assert (pre.status, pre.reason) == ("False", "SettingsNotCarriedOver")
    assert "set nftables.localhostNodePorts: true" in pre.message, pre.message
    assert "acceptDropped: [localhostNodePorts]" in pre.message
    status = run(r.reconcile(nftables_body(3, localhostNodePorts=True), [], {}, events))
    assert "mode: nftables" in config() and "localhostNodePorts: true" in config()
    assert status.condition("Preflight") is None  # nothing held, no agent reported
    ds = api.objs[("DaemonSet", NS, "kpx-agent-default")]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert "--route-localnet-file" in container["command"]
