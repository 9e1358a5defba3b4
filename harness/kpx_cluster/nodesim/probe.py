"""Container probes of the node simulator, executed inside the pod's (or node's) netns.

httpGet and tcpSocket probes need no process at all: a socket is created inside the target
netns (nodesim.netns.socket_in), then the event loop connects and talks over it. exec probes
are processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .netns import socket_in

log = logging.getLogger(__name__)

_netns_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nodesim-netns")


async def connected_socket(netns: str, host: str, port: int) -> socket.socket:
    """A TCP socket connected to host:port from inside `netns` (host: an IP address)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    loop = asyncio.get_running_loop()
    sock = await loop.run_in_executor(_netns_thread, socket_in, netns, family)
    try:
        await loop.sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def tcp_check(netns: str, host: str, port: int, timeout: float) -> bool:
    """A tcpSocket probe: the connection opens within `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            sock = await connected_socket(netns, host, port)
    except (OSError, TimeoutError, ValueError):
        return False
    sock.close()
    return True


async def http_check(
    netns: str,
    host: str,
    port: int,
    path: str,
    timeout: float,
    headers: dict[str, str] | None = None,
    https: bool = False,
) -> bool:
    """An httpGet probe: a status code in [200, 400) within `timeout` seconds."""
    writer: asyncio.StreamWriter | None = None
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout):
            sock = await connected_socket(netns, host, port)
            ctx: ssl.SSLContext | None = None
            if https:  # kubelets do not verify probe certificates
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            reader, writer = await asyncio.open_connection(
                sock=sock, ssl=ctx, server_hostname=host if https else None
            )
            hostport = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            lines = [f"GET {path or '/'} HTTP/1.1", f"Host: {hostport}"]
            lines += ["User-Agent: kube-probe/1.36", "Accept: */*", "Connection: close"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            await writer.drain()
            status_line = await reader.readline()
    except (OSError, TimeoutError, ssl.SSLError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
        elif sock is not None:
            sock.close()
    parts = status_line.split()
    return len(parts) >= 2 and parts[1].isdigit() and 200 <= int(parts[1]) < 400


@dataclass(frozen=True)
class ProbeTiming:
    """The timing fields of a probe, with Kubernetes defaults."""

    initial_delay: float = 0
    period: float = 10
    timeout: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def of(cls, spec: dict[str, Any]) -> ProbeTiming:
        return cls(
            initial_delay=float(spec.get("initialDelaySeconds", 0)),
            period=float(spec.get("periodSeconds", 10)),
            timeout=float(spec.get("timeoutSeconds", 1)),
            success_threshold=int(spec.get("successThreshold", 1)),
            failure_threshold=int(spec.get("failureThreshold", 3)),
        )


class Prober:
    """Runs one probe every period; reports when its result flips (after the thresholds)."""

    def __init__(
        self,
        kind: str,
        timing: ProbeTiming,
        check: Callable[[], Awaitable[bool]],
        initial: bool,
        on_change: Callable[[bool], None],
    ) -> None:
        self.kind = kind
        self.timing = timing
        self.check = check
        self.result = initial
        self.on_change = on_change
        self._streak = 0  # consecutive results that disagree with self.result

    async def run(self) -> None:
        """Probe until cancelled."""
        await asyncio.sleep(self.timing.initial_delay)
        while True:
            try:
                ok = await self.check()
            except Exception:
                log.exception("%s probe crashed", self.kind)
                ok = False
            self._record(ok)
            await asyncio.sleep(self.timing.period)

    def _record(self, ok: bool) -> None:
        if ok == self.result:
            self._streak = 0
            return
        self._streak += 1
        needed = self.timing.success_threshold if ok else self.timing.failure_threshold
        if self._streak >= needed:
            self.result = ok
            self._streak = 0
            self.on_change(ok)


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait for them to finish."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    tasks.clear()
