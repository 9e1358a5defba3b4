"""handover/make_before_break.py: other proxies' leftovers go only after the first verified sync;
failures are counted and retried without stopping anything; a precondition holds a removal back."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from kpx_agent.backends.base import Backend, Handover, NodePaths
from kpx_agent.handover.make_before_break import (
    Draining,
    Leftover,
    LeftoverRemoval,
    other_mode_leftovers,
)
from kpx_agent.model.types import DataplaneSettings
from kpx_api.nodestate import LeftoverKind, LeftoverState


def sample(registry: CollectorRegistry, name: str, leftovers: str) -> float | None:
    return registry.get_sample_value(name, {"leftovers": leftovers})


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for `condition`, however busy the machine (a behaviour, not a deadline: the
    timeout only ends a test that would otherwise hang)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.005)


class StubMode:
    """A mode's module (backends.base.Mode) that records what it is asked."""

    def __init__(self, mode: str, calls: list[tuple[str, Handover]]) -> None:
        self.mode, self.calls = mode, calls

    def create(self, settings: DataplaneSettings, paths: NodePaths | None = None) -> Backend:
        raise AssertionError("a leftover removal creates no backend")

    def cleanup(self) -> None:
        raise AssertionError("another mode's agent removes only leftovers, not everything")

    def remove_leftovers(self, handover: Handover) -> None:
        self.calls.append((self.mode, handover))


def test_other_mode_leftovers_are_every_mode_but_ours_loaded_only_to_remove() -> None:
    """Each other mode's own `remove_leftovers`, with this agent's handover; a mode's code is
    loaded only when its leftovers are removed, not when the list is made."""
    calls: list[tuple[str, Handover]] = []
    loaded: list[str] = []

    def load(mode: str) -> StubMode:
        loaded.append(mode)
        return StubMode(mode, calls)

    handover = Handover(DataplaneSettings(), lambda: False)
    leftovers = other_mode_leftovers("nftables", ["nftables", "iptables", "ipvs"], load, handover)
    assert [x.name for x in leftovers] == ["iptables", "ipvs"] and loaded == []
    for leftover in leftovers:
        leftover.remove()
    assert loaded == ["iptables", "ipvs"]
    assert calls == [("iptables", handover), ("ipvs", handover)]


def test_the_modes_remove_their_leftovers_as_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """nftables and iptables: their full cleanup; ipvs: only what a kpx ipvs agent made, with
    the removing agent's excludeCIDRs and its probe for kube-proxy's ipvs mode."""
    from ipaddress import ip_network

    import kpx_agent.backends.iptables
    import kpx_agent.backends.ipvs
    import kpx_agent.backends.nftables
    from kpx_agent.backends import load
    from kpx_agent.model.types import IPVSOptions

    calls: list[object] = []
    for module in (kpx_agent.backends.nftables, kpx_agent.backends.iptables):
        monkeypatch.setattr(module, "cleanup", lambda m=module.__name__: calls.append(m))
    monkeypatch.setattr(
        kpx_agent.backends.ipvs,
        "remove_kpx_ipvs_leftovers",
        lambda cidrs, probe: calls.append((cidrs, probe)),
    )
    cidrs = (ip_network("10.0.0.0/8"),)

    def probe() -> bool:
        return False

    handover = Handover(DataplaneSettings(ipvs=IPVSOptions(exclude_cidrs=cidrs)), probe)
    for mode in ("nftables", "iptables", "ipvs", "external"):
        load(mode).remove_leftovers(handover)
    assert calls == ["kpx_agent.backends.nftables", "kpx_agent.backends.iptables", (cidrs, probe)]


def test_nothing_is_removed_before_the_first_verified_sync() -> None:
    removed: list[str] = []
    registry = CollectorRegistry()

    async def scenario() -> None:
        verified = asyncio.Event()
        removal = LeftoverRemoval(
            [Leftover("iptables", "iptables rules", lambda: removed.append("iptables"))], registry
        )
        task = asyncio.create_task(removal.run(verified))
        pending = lambda: sample(registry, "kpx_leftovers_pending", "iptables") == 1  # noqa: E731
        await until(pending, "the leftovers counted as pending")
        await asyncio.sleep(0)  # the removal runs up to its wait for the verified sync
        assert removed == []  # the agent's own rules are not in yet
        assert not task.done()
        verified.set()
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert removed == ["iptables"]
    assert sample(registry, "kpx_leftovers_pending", "iptables") == 0


def test_a_failed_removal_is_counted_reported_and_retried() -> None:
    attempts: list[int] = []
    reports: list[tuple[str, str, str]] = []
    registry = CollectorRegistry()

    states: list[list[tuple[str, LeftoverState, str]]] = []

    def flaky() -> None:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("xtables lock held")

    async def report(type_: str, reason: str, message: str) -> None:
        reports.append((type_, reason, message))
        # What the node's ProxyNodeState says at that moment (leftoversPending).
        states.append([(p.name, p.state, p.message) for p in removal.pending_reports()])

    async def scenario() -> None:
        verified = asyncio.Event()
        verified.set()
        await asyncio.wait_for(removal.run(verified), 30)

    other = Leftover("ipvs", "ipvs rules", lambda: None)
    removal = LeftoverRemoval(
        [Leftover("iptables", "iptables rules", flaky), other], registry, report, first_delay=0.01
    )
    assert [(p.name, p.kind, p.state) for p in removal.pending_reports()] == [
        ("iptables", LeftoverKind.KPX_MODE, LeftoverState.PENDING),
        ("ipvs", LeftoverKind.KPX_MODE, LeftoverState.PENDING),
    ]
    asyncio.run(scenario())
    assert states == [
        [
            (
                "iptables",
                LeftoverState.FAILING,
                "could not remove iptables rules (retrying): xtables lock held",
            ),
            ("ipvs", LeftoverState.PENDING, "ipvs rules not removed yet"),
        ]
    ]
    assert removal.pending_reports() == []
    assert len(attempts) == 3
    assert sample(registry, "kpx_leftover_removal_failures_total", "iptables") == 2
    assert sample(registry, "kpx_leftover_removal_failures_total", "ipvs") is None
    assert sample(registry, "kpx_leftovers_pending", "ipvs") == 0
    # One Warning for the first failure, not one per retry.
    assert [(t, r) for t, r, _ in reports] == [("Warning", "LeftoversNotRemoved")]
    assert "xtables lock held" in reports[0][2]


def test_a_precondition_holds_the_removal_back_until_it_holds() -> None:
    gone = {"kube-proxy": False}
    removed: list[str] = []
    reports: list[str] = []
    registry = CollectorRegistry()

    polls: list[bool] = []

    async def ready() -> bool:
        polls.append(gone["kube-proxy"])
        return gone["kube-proxy"]

    async def report(type_: str, reason: str, message: str) -> None:
        reports.append(reason)

    leftover = Leftover(
        "kube-proxy",
        "upstream's rules",
        lambda: removed.append("kube-proxy"),
        ready,
        removed_reason="KubeProxyRulesRemoved",
        waiting_reason="WaitingForKubeProxy",
        waiting_message="kube-proxy still runs here",
        kind=LeftoverKind.KUBE_PROXY,
    )

    async def scenario() -> None:
        verified = asyncio.Event()
        verified.set()
        removal = LeftoverRemoval([leftover], registry, report, poll=0.01)
        task = asyncio.create_task(removal.run(verified))
        await until(lambda: len(polls) >= 3, "the precondition asked three times")
        assert removed == [] and not task.done()
        (waiting,) = removal.pending_reports()
        assert (waiting.kind, waiting.state) == (LeftoverKind.KUBE_PROXY, LeftoverState.WAITING)
        assert waiting.message == "kube-proxy still runs here"
        gone["kube-proxy"] = True
        await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert removed == ["kube-proxy"]
    assert reports == ["WaitingForKubeProxy", "KubeProxyRulesRemoved"]  # waiting told once


def test_a_proxy_that_comes_back_and_leaves_again_has_its_rules_removed_again() -> None:
    """kube-proxy's rules go once it left; a kubeadm upgrade re-creates its DaemonSet, so it
    runs here again (and programs its rules again): once it has left again, they go again."""
    gone = {"kube-proxy": True}
    removed: list[str] = []
    reports: list[tuple[str, str]] = []
    registry = CollectorRegistry()

    polls: list[bool] = []

    async def ready() -> bool:
        polls.append(gone["kube-proxy"])
        return gone["kube-proxy"]

    async def report(type_: str, reason: str, message: str) -> None:
        reports.append((reason, message))

    async def polled(times: int) -> None:
        asked = len(polls) + times
        await until(lambda: len(polls) >= asked, f"the precondition asked {times} more times")

    leftover = Leftover(
        "kube-proxy",
        "upstream's rules",
        lambda: removed.append("kube-proxy"),
        ready,
        removed_reason="KubeProxyRulesRemoved",
        waiting_reason="WaitingForKubeProxy",
        waiting_message="kube-proxy still runs here",
        rearm=True,
        returned_reason="WaitingForKubeProxy",
        returned_message="kube-proxy runs here again",
    )

    async def scenario() -> None:
        verified = asyncio.Event()
        verified.set()
        removal = LeftoverRemoval([leftover], registry, report, poll=0.01, watch_poll=0.01)
        task = asyncio.create_task(removal.run(verified))
        await until(lambda: removed == ["kube-proxy"], "the rules removed once")
        await polled(3)
        assert removed == ["kube-proxy"] and not task.done()  # removed once, still watching
        assert sample(registry, "kpx_leftovers_pending", "kube-proxy") == 0
        gone["kube-proxy"] = False  # back
        await until(lambda: len(reports) == 2, "its return reported")
        await polled(3)
        assert removed == ["kube-proxy"]  # never while it runs
        # Its ProxyNodeState says it is pending again, waiting (the operator's takeover phase).
        assert [(p.name, p.state, p.message) for p in removal.pending_reports()] == [
            ("kube-proxy", LeftoverState.WAITING, "kube-proxy runs here again")
        ]
        assert [r for r, _ in reports] == ["KubeProxyRulesRemoved", "WaitingForKubeProxy"]
        gone["kube-proxy"] = True  # left again
        await until(lambda: len(removed) == 2, "the rules removed again")
        assert sample(registry, "kpx_leftovers_pending", "kube-proxy") == 0
        await polled(3)
        assert removed == ["kube-proxy", "kube-proxy"]  # not again while it stays away
        task.cancel()

    asyncio.run(scenario())
    assert reports == [
        ("KubeProxyRulesRemoved", "removed upstream's rules"),
        ("WaitingForKubeProxy", "kube-proxy runs here again"),
        ("KubeProxyRulesRemoved", "removed upstream's rules"),
    ]


def test_a_precondition_that_cannot_be_checked_is_retried() -> None:
    calls: list[int] = []
    registry = CollectorRegistry()

    async def ready() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("apiserver unreachable")
        return True

    async def scenario() -> None:
        verified = asyncio.Event()
        verified.set()
        removal = LeftoverRemoval(
            [Leftover("kube-proxy", "x", lambda: None, ready)], registry, first_delay=0.01
        )
        await asyncio.wait_for(removal.run(verified), 30)
        assert not removal.pending

    asyncio.run(scenario())
    assert len(calls) == 2


@pytest.mark.parametrize("takeover", [False, True])
@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_the_agent_cli_builds_the_removal_after_the_first_sync(mode: str, takeover: bool) -> None:
    """cli.build_agent: the agent is built with its leftover removal, a companion that waits
    for its verified sync; with spec.takeover.fromKubeProxy, kube-proxy's rules are one more
    kind, behind a precondition. Readiness waits for a switch's old mode only."""
    import dataclasses

    from kpx_agent import cli
    from kpx_agent import settings as settings_mod
    from kpx_agent.backends import load
    from kpx_kube import Client, Credentials

    args = cli._run_parser().parse_args(["--mode", mode, "--node-name", "n1"])
    settings = settings_mod.resolve(settings_mod.load(mode, None, cli._overrides(args)))
    settings = dataclasses.replace(settings, takeover_from_kube_proxy=takeover)
    client = Client(Credentials("https://127.0.0.1:1", ssl.create_default_context()))
    agent = cli.build_agent(settings, load(mode), args, client)
    removal = agent.leftover_removal
    assert removal is not None and agent.leftovers_of is not None
    assert agent.backend.mode == mode and agent.preflight is not None
    # During a switch from ipvs, not Ready until ipvs's rules are gone; the other kinds (and
    # kube-proxy's) do not count, nor anything outside a switch.
    agent.switching_from = lambda: {"ipvs"}  # type: ignore[method-assign]
    assert agent.health.leftovers_pending() == "the rules of kpx mode ipvs not removed yet"
    agent.switching_from = lambda: set()  # type: ignore[method-assign]
    assert agent.health.leftovers_pending() == ""
    assert mode not in removal.pending and {"iptables", "nftables", "ipvs"} - {mode} <= set(
        removal.pending
    )
    assert ("kube-proxy" in removal.pending) is takeover
    if takeover:
        assert removal.pending["kube-proxy"].ready is not None


def test_removing_another_modes_rules_is_reported_naming_the_mode() -> None:
    """status.modeSwitch counts a node Switched on this Event (the message names the mode)."""
    reports: list[tuple[str, str, str]] = []
    registry = CollectorRegistry()

    async def report(type_: str, reason: str, message: str) -> None:
        reports.append((type_, reason, message))

    async def scenario() -> None:
        verified = asyncio.Event()
        verified.set()
        leftovers = other_mode_leftovers(
            "nftables",
            ["nftables", "iptables"],
            lambda m: StubMode(m, []),
            Handover(DataplaneSettings(), lambda: False),
        )
        await asyncio.wait_for(LeftoverRemoval(leftovers, registry, report).run(verified), 2)

    asyncio.run(scenario())
    assert reports == [("Normal", "LeftoversRemoved", "removed the rules of kpx mode iptables")]


def test_a_draining_removal_is_retried_without_failing_or_holding_readiness() -> None:
    """kpx's IPVS virtual servers with connections through them stay until those end: the
    removal says so (Draining), which is no failure, is reported once, does not hold the
    agent's readiness during a switch, and is tried again until it completes."""
    left = {"connections": 2}
    tries: list[int] = []
    reports: list[tuple[str, str]] = []
    registry = CollectorRegistry()

    def remove() -> None:
        tries.append(left["connections"])
        if left["connections"]:
            if len(tries) > 1:  # the first connection ends after the test has looked
                left["connections"] -= 1
            raise Draining("1 of kpx's IPVS virtual servers still carry connections")

    async def report(type_: str, reason: str, message: str) -> None:
        reports.append((type_, reason))

    async def scenario() -> LeftoverRemoval:
        verified = asyncio.Event()
        verified.set()
        removal = LeftoverRemoval(
            [Leftover("ipvs", "the rules of kpx mode ipvs", remove)],
            registry,
            report,
            drain_poll=0.05,
        )
        task = asyncio.create_task(removal.run(verified))
        await until(lambda: len(tries) == 1, "a first removal that drains")
        assert "ipvs" in removal.pending and removal.blocking({"ipvs"}) == ""
        await asyncio.wait_for(task, 30)
        return removal

    removal = asyncio.run(scenario())
    assert left["connections"] == 0 and not removal.pending
    assert reports == [("Normal", "LeftoversDraining")]
    assert sample(registry, "kpx_leftover_removal_failures_total", "ipvs") in (None, 0.0)
    assert sample(registry, "kpx_leftovers_pending", "ipvs") == 0
