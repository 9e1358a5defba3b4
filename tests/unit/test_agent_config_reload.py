"""README: "a changed file is picked up live, and a bad change is refused while the previous
configuration stays" (Agent.reload_config, the real loader and agent)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_agent_rollback import _Backend, _Client

from kpx_agent import settings as settings_mod
from kpx_agent.agent import Agent


def test_a_bad_change_is_refused_while_the_previous_configuration_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("mode: nftables\nnftables: {masqueradeBit: 9}\n")
    settings = settings_mod.resolve(settings_mod.load("nftables", path))
    backend = _Backend("nftables", settings.proxy)
    agent = Agent(settings, "n1", _Client(), backend, config_path=path)  # type: ignore[arg-type]
    before = agent.settings

    def failures() -> float | None:
        return agent.metrics.registry.get_sample_value("kpx_config_reload_failures_total")

    # A field out of range, a YAML that does not parse, a mode this agent does not run.
    bad = {
        "mode: nftables\nnftables: {masqueradeBit: 99}\n": "masqueradeBit",
        "mode: nftables\nnftables: {masqueradeBit: [\n": "config.yaml",
        "mode: iptables\n": "mode changed to iptables",
    }
    with caplog.at_level(logging.ERROR):
        for n, (text, named) in enumerate(bad.items(), 1):
            path.write_text(text)
            assert not agent.reload_config(), text
            assert agent.settings is before
            assert agent.proxier.settings.masquerade_bit == 9
            assert backend.settings.masquerade_bit == 9
            assert failures() == n
            assert named in caplog.records[-1].getMessage()

    # A good change after the refused ones is applied live.
    path.write_text("mode: nftables\nnftables: {masqueradeBit: 11}\n")
    assert agent.reload_config()
    assert agent.settings.proxy.masquerade_bit == 11 and backend.settings.masquerade_bit == 11
    assert failures() == len(bad)
