"""The probe's CLI (`python -m kpx_cluster.probe`), for a shell in any netns: the tests call
`probe`, which makes the same tries in a thread inside the netns, so the CLI is checked here,
against a loopback listener."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kpx_cluster import probe


@pytest.fixture
def answering_port() -> Iterator[int]:
    """A loopback TCP listener that answers each connection with `b1 <client ip>`."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, (ip, _port) = server.accept()
                with conn:
                    conn.sendall(f"b1 {ip}\n".encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        server.close()


def test_the_cli_prints_what_the_tries_saw(
    answering_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{answering_port}"
    assert probe.main(["--target", target, "--count", "3", "--timeout", "2"]) == 0
    result = probe.ProbeResult.from_json(capsys.readouterr().out)
    assert result.answers == {"b1": 3} and result.sources == {"b1": ["127.0.0.1"]}
    assert result.failed == 0


def test_the_cli_counts_a_refused_connection(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # bound, not listening: refused
        assert probe.main(["--target", f"127.0.0.1:{port}", "--timeout", "1"]) == 0
    result = probe.ProbeResult.from_json(capsys.readouterr().out)
    assert (result.refused, result.answered) == (1, 0)
