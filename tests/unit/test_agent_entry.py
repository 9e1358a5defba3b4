"""The `proxy-agent` entry point (kpx_agent/__main__.py): the CLI imported with the cyclic
collector off, and the collector as it was before anything runs."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kpx_agent import __main__ as entry


@pytest.fixture
def gc_state() -> Iterator[None]:
    enabled = gc.isenabled()
    yield
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_runs_the_cli_with_the_collector_back_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gc_state: None
) -> None:
    seen: list[bool] = []
    monkeypatch.setattr(sys, "argv", ["proxy-agent"])
    monkeypatch.setattr("kpx_agent.cli.main", lambda: seen.append(gc.isenabled()) or 2)
    gc.enable()
    assert entry.main() == 2
    assert seen == [True]  # on again before the CLI runs
    assert gc.isenabled()


def test_leaves_a_disabled_collector_disabled(
    monkeypatch: pytest.MonkeyPatch, gc_state: None
) -> None:
    monkeypatch.setattr("kpx_agent.cli.main", lambda: 0)
    gc.disable()
    assert entry.main() == 0
    assert not gc.isenabled()


def test_python_m_kpx_agent_is_the_agent_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kpx_agent"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "give --mode, --config, or both" in done.stderr
