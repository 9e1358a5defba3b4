"""The agent's health and metrics servers wait for their address (issue #18): during a takeover
upstream kube-proxy holds 0.0.0.0:10256 and 127.0.0.1:10249 on the node until it is moved off;
the agent retries the bind as upstream does instead of exiting."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from kpx_agent.observability.http_endpoints import RetryingServer, health_app
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.observability.proxy_health import ProxyHealth


def _app() -> Any:
    return health_app(ProxyHealth(timeout=0.0), AgentMetrics())


def _get(port: int) -> str:
    """The status line of GET /livez (a raw request: the agent's own endpoint)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(b"GET /livez HTTP/1.0\r\nHost: x\r\n\r\n")
        return conn.recv(4096).decode().split("\r\n", 1)[0]


def test_binds_once_the_other_process_released_the_address() -> None:
    async def scenario() -> None:
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = RetryingServer(_app(), "127.0.0.1", port, "healthz", retry=0.05)
        await server.start()  # does not raise: the address is in use
        assert not server.serving
        await asyncio.sleep(0.2)
        assert not server.serving
        taken.close()
        for _ in range(600):  # up to 30 s: binds at its next retry, however busy the machine
            if server.serving:
                break
            await asyncio.sleep(0.05)
        assert server.serving
        assert (await asyncio.to_thread(_get, port)).endswith(" 200 OK")
        await server.cleanup()

    asyncio.run(scenario())


def test_a_free_address_serves_at_once_and_other_errors_are_raised() -> None:
    async def scenario() -> None:
        server = RetryingServer(_app(), "127.0.0.1", 0, "healthz")
        await server.start()
        assert server.serving
        await server.cleanup()
        bad = RetryingServer(_app(), "192.0.2.1", 10256, "healthz")  # not an address of ours
        with pytest.raises(OSError):
            await bad.start()
        assert not bad.serving

    asyncio.run(scenario())


def test_cleanup_stops_the_retries() -> None:
    async def scenario() -> None:
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = RetryingServer(_app(), "127.0.0.1", port, "healthz", retry=0.05)
        await server.start()
        await server.cleanup()
        taken.close()
        await asyncio.sleep(0.2)
        assert not server.serving

    asyncio.run(scenario())
