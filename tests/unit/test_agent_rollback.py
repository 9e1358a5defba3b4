"""The agent's rollback during a switch of mode (rollback.py, settings, /readyz) and the
readiness gate on the other modes' leftovers (handover/make_before_break.py): the pure parts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kpx_agent import settings as settings_mod
from kpx_agent.backends.base import Backend
from kpx_agent.handover.make_before_break import Leftover, LeftoverRemoval
from kpx_agent.handover.rollback import ERROR_LIMIT, rollback_due, rolled_back_message, seconds_left
from kpx_agent.model.types import DataplaneSettings
from kpx_agent.observability.proxy_health import ProxyHealth
from kpx_agent.settings import RollbackSettings
from kpx_api.agentconfig import parse_agent_config


class _Client:
    """No apiserver: the agent's reflectors are not run here."""

    async def ready(self) -> bool:
        return False


def _rollback(deadline: float = 30.0) -> RollbackSettings:
    config = parse_agent_config({"mode": "iptables"})
    return RollbackSettings(settings_mod.resolve(config), deadline)


def test_the_rollback_is_due_at_the_deadline_without_a_verified_sync_and_only_once() -> None:
    rb = _rollback(30.0)
    off = RollbackSettings(rb.settings, 30.0, enabled=False)
    assert not rollback_due(off, verified=False, rolled_back=False, running_for=99)
    assert seconds_left(off, False, False, 1.0) is None
    assert not rollback_due(rb, verified=False, rolled_back=False, running_for=29.9)
    assert rollback_due(rb, verified=False, rolled_back=False, running_for=30.0)
    assert not rollback_due(rb, verified=True, rolled_back=False, running_for=99)
    assert not rollback_due(rb, verified=False, rolled_back=True, running_for=99)
    assert not rollback_due(None, verified=False, rolled_back=False, running_for=99)
    assert seconds_left(rb, False, False, 12.5) == 17.5
    assert seconds_left(rb, False, False, 31.0) == 0.0
    assert seconds_left(rb, True, False, 1.0) is None
    assert seconds_left(rb, False, True, 1.0) is None
    assert seconds_left(None, False, False, 1.0) is None


def test_the_rolled_back_message_names_the_modes_the_deadline_and_the_kernels_error() -> None:
    assert rolled_back_message("nftables", 30, "nft: Operation not permitted", "iptables") == (
        "nftables never synced within 30s: nft: Operation not permitted; serving with iptables "
        "again"
    )
    long = rolled_back_message("nftables", 10, "e" * 1000, "iptables")
    assert len(long) < ERROR_LIMIT + 80 and "e..." in long
    assert "no sync attempted" in rolled_back_message("nftables", 10, "", "iptables")


def test_the_configurations_rollback_resolves_to_the_old_modes_settings(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "mode: nftables\nnftables: {syncPeriod: 10s}\nclusterCIDRs: [10.244.0.0/16]\n"
        "rollback:\n  mode: iptables\n  progressDeadlineSeconds: 12\n"
        "  iptables: {masqueradeBit: 9, localhostNodePorts: false, minSyncPeriod: 2s}\n"
    )
    got = settings_mod.resolve(settings_mod.load("nftables", path))
    assert got.mode == "nftables" and got.sync_period == 10
    assert got.rollback is not None and got.rollback.deadline == 12
    back = got.rollback.settings
    assert (back.mode, back.min_sync_period, back.proxy.masquerade_bit) == ("iptables", 2, 9)
    assert not back.proxy.localhost_node_ports
    assert back.proxy.cluster_cidrs == got.proxy.cluster_cidrs  # the shared settings
    assert back.rollback is None
    plain = settings_mod.resolve(settings_mod.load("nftables", None))
    assert plain.rollback is None


def test_readiness_waits_for_the_leftovers_and_ends_for_good_with_a_rollback() -> None:
    health = ProxyHealth(60.0, clock=lambda: 1000.0)
    code, body = health.readyz()
    assert code == 503 and body["notReady"] == "first sync not verified yet"
    health.verified_first_sync()
    health.leftovers_pending = lambda: "the rules of kpx mode iptables not removed yet"
    code, body = health.readyz()
    assert code == 503 and body["notReady"] == "the rules of kpx mode iptables not removed yet"
    health.leftovers_pending = lambda: ""
    code, body = health.readyz()
    assert code == 200 and "notReady" not in body
    health.rolled_back = "nftables never synced within 30s: EPERM; serving with iptables again"
    code, body = health.readyz()
    assert code == 503 and str(body["notReady"]).startswith("rolled back: nftables never")
    # /healthz stays upstream's: the node is served (by the rollback mode's rules).
    assert health.healthz()[0] == 200


def test_the_removal_tells_why_the_agent_is_not_ready_until_the_old_modes_rules_are_gone() -> None:
    told: list[str] = []
    attempts = {"n": 0}

    def flaky() -> None:
        attempts["n"] += 1
        if attempts["n"] < 3:
            raise RuntimeError("xtables lock held")

    gate = Leftover("iptables", "the rules of kpx mode iptables", flaky)
    other = Leftover(
        "kube-proxy", "upstream kube-proxy's rules", lambda: None, ready=lambda: _false()
    )
    switch_from = {"iptables"}

    async def scenario() -> None:
        verified = asyncio.Event()
        removal = LeftoverRemoval([gate, other], CollectorRegistry(), first_delay=0.01, poll=0.01)
        task = asyncio.create_task(removal.run(verified))
        told.append(removal.blocking(switch_from))
        verified.set()
        for _ in range(500):
            await asyncio.sleep(0.002)
            now = removal.blocking(switch_from)
            if now != told[-1]:
                told.append(now)
            if not now:
                break
        await asyncio.sleep(0.05)
        task.cancel()
        # kube-proxy's rules wait (its Pod still runs) and do not hold readiness.
        assert "kube-proxy" in removal.pending and removal.blocking(switch_from) == ""
        assert removal.blocking({"kube-proxy"}) == "upstream kube-proxy's rules not removed yet"

    asyncio.run(scenario())
    assert told[0] == "the rules of kpx mode iptables not removed yet"
    assert "could not remove the rules of kpx mode iptables (retrying): xtables lock held" in told
    assert told[-1] == ""


async def _false() -> bool:
    return False


def test_a_removal_is_reset_to_another_modes_leftovers_after_a_rollback() -> None:
    registry = CollectorRegistry()
    removal = LeftoverRemoval(
        [Leftover("iptables", "the rules of kpx mode iptables", lambda: None)], registry
    )
    removal.reset([Leftover("nftables", "the rules of kpx mode nftables", lambda: None)])
    assert set(removal.pending) == {"nftables"}
    assert removal.blocking({"nftables"}) == "the rules of kpx mode nftables not removed yet"
    assert registry.get_sample_value("kpx_leftovers_pending", {"leftovers": "nftables"}) == 1
    assert registry.get_sample_value("kpx_leftovers_pending", {"leftovers": "iptables"}) is None


@pytest.mark.parametrize("mode", ["external"])
def test_no_rollback_block_names_a_mode_without_a_kernel_backend(mode: str) -> None:
    from kpx_api.errors import ConfigError

    with pytest.raises(ConfigError, match="kernel mode"):
        parse_agent_config(
            {"mode": "nftables", "rollback": {"mode": mode, "progressDeadlineSeconds": 10}}
        )


class _Backend(Backend):
    def __init__(self, mode: str, settings: DataplaneSettings) -> None:
        self.mode, self.settings = mode, settings
        self.syncs = 0

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings

    def sync(self, state: object, changed: object) -> None:
        self.syncs += 1

    def cleanup(self) -> None:
        return None


def test_the_agent_rolls_back_in_process_and_keeps_the_old_modes_settings_live(
    tmp_path: Path,
) -> None:
    """Agent.roll_back: the rollback mode's backend and settings from then on, a full sync
    asked for, not Ready for good, the leftovers of the failed mode to remove instead; a
    reloaded configuration updates the rollback mode's settings."""
    import time

    from kpx_agent.agent import Agent

    path = tmp_path / "config.yaml"
    config = (
        "mode: nftables\nrollback:\n  mode: iptables\n  progressDeadlineSeconds: 10\n"
        "  iptables: {{masqueradeBit: {bit}}}\n"
    )
    path.write_text(config.format(bit=9))
    settings = settings_mod.resolve(settings_mod.load("nftables", path))
    made: list[_Backend] = []

    def backend_for(s: settings_mod.AgentSettings) -> _Backend:
        made.append(_Backend(s.mode, s.proxy))
        return made[-1]

    agent = Agent(
        settings,
        "n1",
        _Client(),
        _Backend("nftables", settings.proxy),  # type: ignore[arg-type]
        config_path=path,
        backend_for=backend_for,
        leftovers_of=lambda s: [
            Leftover(m, f"the rules of kpx mode {m}", lambda: None)
            for m in ("nftables", "iptables")
            if m != s.mode
        ],
    )  # type: ignore[arg-type]
    # During the switch the old mode's rules hold readiness.
    assert agent.switching_from() == {"iptables"}

    async def scenario() -> None:
        agent._start_leftover_removal()
        agent._last_error = "nft: Operation not permitted"
        agent._started = time.monotonic() - 5
        assert agent.rollback_left() == pytest.approx(5, abs=0.5)
        assert not await agent.roll_back()  # not yet
        agent._started = time.monotonic() - 10
        assert agent.rollback_left() == 0.0
        assert await agent.roll_back()
        assert not await agent.roll_back()  # once
        assert agent.rollback_left() is None
        assert agent.leftover_removal is not None
        assert set(agent.leftover_removal.pending) == {"nftables"}
        assert not agent.first_sync_verified.is_set()
        if agent._removal_task is not None:
            agent._removal_task.cancel()

    asyncio.run(scenario())
    assert [b.mode for b in made] == ["iptables"]
    assert agent.backend is made[0] and agent.proxier.backend is made[0]
    assert agent.proxier.settings is made[0].settings  # the model's settings: the new mode's
    assert agent.settings.mode == "iptables" and agent.settings.proxy.masquerade_bit == 9
    assert agent.rolled_back == (
        "nftables never synced within 10s: nft: Operation not permitted; serving with iptables "
        "again"
    )
    code, body = agent.health.readyz()
    assert code == 503 and "rolled back" in str(body["notReady"])
    assert (
        agent.metrics.registry.get_sample_value(
            "kpx_rolled_back", {"mode": "nftables", "to": "iptables"}
        )
        == 1
    )
    assert agent.proxier.prepare().full  # the rollback mode's rules are programmed in full
    assert agent.switching_from() == set()

    # The operator changes the old mode's settings (spec unchanged otherwise): applied live.
    path.write_text(config.format(bit=11))
    assert agent.reload_config()
    assert agent.settings.mode == "iptables" and made[0].settings.masquerade_bit == 11  # type: ignore[attr-defined]
    # The switch is over (no rollback in the configuration): the rollback mode stays as it is.
    path.write_text("mode: nftables\n")
    assert not agent.reload_config()
    assert agent.settings.mode == "iptables"
    # spec.mode set back: the configuration is the rollback mode's own.
    path.write_text("mode: iptables\niptables: {masqueradeBit: 12}\n")
    assert agent.reload_config()
    assert made[0].settings.masquerade_bit == 12  # type: ignore[attr-defined]
    assert agent.proxier.settings == made[0].settings  # the model and the backend are told


def test_a_table_owned_by_a_running_process_is_told_from_kpxs_own() -> None:
    """nftables cleanup leaves a kpx-named table with `flags owner` (a running process's, which
    the kernel removes with it; kpx never makes one): so an owned table cannot hold an agent's
    removal of the nftables leftovers, and its readiness, forever."""
    from kpx_agent.backends.nftables.kernel import carries_owner_flag

    owned = "table ip kpx { # progname nft\n\tflags owner\n\n\tchain c {\n\t}\n}\n"
    assert carries_owner_flag(owned)
    assert carries_owner_flag("table ip kpx {\n\tflags dormant,owner\n}\n")
    assert not carries_owner_flag("table ip kpx {\n\tchain c {\n\t\tflags owner\n\t}\n}\n")
    assert not carries_owner_flag("table ip kpx {\n\tchain services {\n\t}\n}\n")
    assert not carries_owner_flag("")


def test_the_node_state_reports_the_generation_synced_and_the_rollback(tmp_path: Path) -> None:
    """Agent.node_facts: the generation beside the configuration counts once synced (at
    once when the reload needs no sync); after a rollback, the old mode and why."""
    import time

    from kpx_agent.agent import Agent

    path = tmp_path / "config.yaml"
    path.write_text("mode: nftables\nrollback:\n  mode: iptables\n  progressDeadlineSeconds: 10\n")
    (tmp_path / "generation").write_text("3")
    settings = settings_mod.resolve(settings_mod.load("nftables", path))
    agent = Agent(
        settings,
        "n1",
        _Client(),
        _Backend("nftables", settings.proxy),  # type: ignore[arg-type]
        config_path=path,
        backend_for=lambda s: _Backend(s.mode, s.proxy),
    )  # type: ignore[arg-type,return-value]
    facts = agent.node_facts()
    assert (facts.mode, facts.generation, facts.verified, facts.rolled_back) == (
        "nftables",
        None,
        False,
        "",
    )
    assert agent._loaded_generation == 3
    (tmp_path / "generation").write_text("4")  # a spec change the configuration does not show
    assert agent.reload_config()
    assert agent.node_facts().generation == 4

    async def roll_back() -> None:
        agent._started = time.monotonic() - 11
        assert await agent.roll_back()

    asyncio.run(roll_back())
    facts = agent.node_facts()
    assert facts.mode == "iptables" and facts.rolled_back.startswith("nftables never synced")


def test_a_rollback_that_itself_fails_keeps_the_mode_says_why_and_is_not_tried_again(
    tmp_path: Path,
) -> None:
    """The rollback mode's backend cannot be made (say its kernel module is missing): the agent
    keeps the failed mode and its backend (which goes on retrying), is not Ready for good with
    both failures named, and does not try the rollback again."""
    import time

    from kpx_agent.agent import Agent

    path = tmp_path / "config.yaml"
    path.write_text("mode: nftables\nrollback:\n  mode: iptables\n  progressDeadlineSeconds: 10\n")
    settings = settings_mod.resolve(settings_mod.load("nftables", path))
    tries: list[str] = []

    def backend_for(s: settings_mod.AgentSettings) -> _Backend:
        tries.append(s.mode)
        raise OSError("iptables-nft: module ip_tables not found")

    nftables = _Backend("nftables", settings.proxy)
    agent = Agent(
        settings,
        "n1",
        _Client(),
        nftables,  # type: ignore[arg-type]
        config_path=path,
        backend_for=backend_for,
    )  # type: ignore[arg-type]

    async def scenario() -> None:
        agent._last_error = "nft: Operation not permitted"
        agent._started = time.monotonic() - 10
        assert agent.rollback_left() == 0.0
        assert not await agent.roll_back()
        assert not await agent.roll_back()  # not again

    asyncio.run(scenario())
    assert tries == ["iptables"]
    assert agent.backend is nftables and agent.proxier.backend is nftables
    assert agent.settings.mode == "nftables"
    assert agent.rolled_back == (
        "nftables never synced and rolling back to iptables failed: "
        "iptables-nft: module ip_tables not found"
    )
    code, body = agent.health.readyz()
    assert code == 503 and "rolling back to iptables failed" in str(body["notReady"])
    assert agent.metrics.registry.get_sample_value(
        "kpx_rolled_back", {"mode": "nftables", "to": "iptables"}
    ) in (None, 0.0)
