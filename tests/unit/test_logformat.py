"""kpx_kube.logformat: klog's --logging-format=json keys, -v levels, structured fields."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from kpx_agent.sync.proxier import SyncOutcome
from kpx_agent.sync.sync_log import log_sync
from kpx_kube import logformat


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_json_lines_carry_klogs_keys_and_verbosity(restore_root: None) -> None:
    out = io.StringIO()
    logformat.configure(logformat.JSON, 4, out)
    log = logging.getLogger("kpx_agent.test")
    log.debug("detail %d", 1)
    log.info("hello %s", "world")
    log.warning("careful")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    debug, info, warning, error = lines(out)
    assert info["msg"] == "hello world" and info["v"] == 0 and info["logger"] == "kpx_agent.test"
    assert isinstance(info["ts"], float) and str(info["caller"]).startswith("test_logformat.py:")
    assert debug["v"] == 4
    assert warning["level"] == "warning" and "v" not in warning
    assert error["level"] == "error" and "RuntimeError: boom" in str(error["err"])


def test_verbosity_below_four_drops_debug(restore_root: None) -> None:
    out = io.StringIO()
    logformat.configure(logformat.JSON, 2, out)
    logging.getLogger("kpx_agent.test").debug("hidden")
    logging.getLogger("kpx_agent.test").info("shown")
    assert [r["msg"] for r in lines(out)] == ["shown"]


def test_one_sync_line_has_mode_counts_and_duration_as_keys(restore_root: None) -> None:
    out = io.StringIO()
    logformat.configure(logformat.JSON, 0, out)
    log_sync("nftables", SyncOutcome(True, False, 3, 0.0123), 42)
    (record,) = lines(out)
    assert record["mode"] == "nftables" and record["full"] is False
    assert record["changedServicePorts"] == 3 and record["servicePorts"] == 42
    assert record["durationSeconds"] == 0.0123
    assert record["msg"].startswith("synced nftables: partial sync")  # type: ignore[union-attr]


def test_text_is_the_default_and_v_parses_as_klogs() -> None:
    import argparse

    p = argparse.ArgumentParser()
    logformat.add_arguments(p)
    assert p.parse_args([]).logging_format == "text"
    assert p.parse_args([]).verbosity == 0
    assert p.parse_args(["-v"]).verbosity == 4
    assert p.parse_args(["-v=2"]).verbosity == 2
    assert p.parse_args(["--v", "5", "--logging-format=json"]).logging_format == "json"
    with pytest.raises(SystemExit):
        p.parse_args(["--logging-format", "xml"])
    assert logformat.early_format(["--logging-format", "json"]) == "json"
    assert logformat.early_format(["-v"]) == "text"
