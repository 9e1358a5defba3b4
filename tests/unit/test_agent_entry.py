"""The `proxy-agent` entry point (kpx_agent/__main__.py): the CLI imported with the cyclic
collector off, and the collector as it was before anything runs."""

from __future__ import annotations

import gc
import os
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


# In a fresh interpreter (the import is what is measured): the young generation's count when
# the collector is back on, printed by a stand-in for gc.enable.
YOUNG_PROBE = """
import gc, sys, types
from kpx_agent import __main__ as entry
def enable():
    gc.enable()
    print("young", gc.get_count()[0], "frozen", gc.get_freeze_count(), flush=True)
entry.gc = types.SimpleNamespace(
    isenabled=gc.isenabled, disable=gc.disable, freeze=gc.freeze, enable=enable
)
sys.argv = ["proxy-agent"]
sys.exit(entry.main())
"""


def test_what_the_import_made_is_frozen_before_the_collector_is_back_on() -> None:
    done = subprocess.run(
        [sys.executable, "-c", YOUNG_PROBE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    words = done.stdout.split()
    young, frozen = int(words[words.index("young") + 1]), int(words[words.index("frozen") + 1])
    # The import makes tens of thousands of tracked objects: frozen, they leave nothing for
    # the first pass (at the first allocation after) to scan.
    assert frozen > 10_000
    assert young < 100


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


# Run in a fresh interpreter (aiohttp is imported once per process): the entry point with no
# arguments (the CLI refuses them, exit 2), then what aiohttp's default contexts and a context
# made afterwards from the system's CAs trust.
CA_PROBE = """
import os, sys
sys.argv = ["proxy-agent"]
from kpx_agent import __main__ as entry
assert entry.main() == 2
import aiohttp.connector as connector
from kpx_kube import tls
print(os.environ.get("SSL_CERT_FILE", "unset"))
print(connector._SSL_CONTEXT_VERIFIED.cert_store_stats()["x509_ca"])
print(tls.ssl_context().cert_store_stats()["x509_ca"] > 0)
"""


def test_aiohttp_is_imported_without_parsing_the_system_ca_bundle() -> None:
    """aiohttp's import-time default contexts (never used by the agent) load no CA, and the
    variable that made it so is gone before the CLI runs: a context the agent makes later
    from the system's CAs still has them."""
    env = {k: v for k, v in os.environ.items() if k != "SSL_CERT_FILE"}
    done = subprocess.run(
        [sys.executable, "-c", CA_PROBE], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.stdout.split() == ["unset", "0", "True"], done.stdout + done.stderr


def test_an_ssl_cert_file_given_to_the_agent_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []
    monkeypatch.setenv("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
    monkeypatch.setattr(
        "kpx_agent.cli.main", lambda: seen.append(os.environ.get("SSL_CERT_FILE")) or 0
    )
    assert entry.main() == 0
    assert seen == ["/etc/ssl/certs/ca-certificates.crt"]
