"""`backends.kernel.tool_input.feed`: a tool's input written while it is made (nft -f -,
iptables-restore), with stand-in tools (a Python reader, `true`, `sleep`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kpx_agent.backends.base import BackendError
from kpx_agent.backends.kernel.tool_input import WRITE_BYTES, feed

# Reads its whole input, then writes it to the file named by argv[1] (only after the end).
READER = "import sys; data = sys.stdin.read(); open(sys.argv[1], 'w').write(data)"


def test_the_whole_input_reaches_the_tool(tmp_path: Path) -> None:
    out = tmp_path / "read"
    pieces = [f"line {i}\n" for i in range(20_000)]  # several writes' worth
    fed = feed([sys.executable, "-c", READER, str(out)], iter(pieces))
    assert (fed.status, fed.whole, fed.timed_out) == (0, True, False)
    assert out.read_text() == "".join(pieces)
    assert len("".join(pieces)) > 2 * WRITE_BYTES


def test_a_piece_that_fails_to_be_made_kills_the_tool_before_its_input_ends(
    tmp_path: Path,
) -> None:
    """The tool never sees the end of its input (so nft or iptables-restore commit nothing)."""
    out = tmp_path / "read"

    def pieces() -> Iterator[str]:
        yield "x" * (3 * WRITE_BYTES)  # written: the tool has started reading
        raise RuntimeError("a bug while rendering")

    with pytest.raises(RuntimeError, match="a bug"):
        feed([sys.executable, "-c", READER, str(out)], pieces())
    assert not out.exists()


def test_a_tool_that_stops_reading_stops_the_feeding() -> None:
    made = [0]

    def pieces() -> Iterator[str]:
        for _ in range(1000):
            made[0] += 1
            yield "y" * 10_000  # 10 MB in all: more than a pipe holds

    fed = feed(["true"], pieces())
    assert fed.status == 0 and not fed.whole
    assert made[0] < 1000


def test_the_timeout_kills_the_tool() -> None:
    fed = feed(["sleep", "30"], ["nothing read\n"], timeout=0.3)
    assert fed.timed_out and fed.status < 0


def test_a_tool_that_is_missing_or_cannot_be_run_is_a_backend_error(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="/nonexistent/tool is not installed"):
        feed(["/nonexistent/tool"], ["x"])
    with pytest.raises(BackendError, match="cannot run"):
        feed([str(tmp_path)], ["x"])  # a directory: EACCES
