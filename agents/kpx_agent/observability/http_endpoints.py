"""kube-proxy compatible health (/healthz, /livez), readiness (/readyz, kpx's own), liveness for
the kubelet (/alivez, kpx's own), metrics (/metrics) and mode (/proxyMode) endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from .metrics import AgentMetrics
from .proxy_health import ProxyHealth

log = logging.getLogger(__name__)
#: Upstream kube-proxy retries a healthz or metrics server that failed (its address in use)
#: every 5 s, unless bindAddressHardFail (cmd/kube-proxy/app/server.go, serveHealthz).
BIND_RETRY = 5.0


def health_app(health: ProxyHealth, metrics: AgentMetrics) -> web.Application:
    """/healthz and /livez over `health`, counted by status code as upstream does; /readyz and
    /alivez (not counted: upstream has no such endpoints)."""

    async def healthz(_: web.Request) -> web.Response:
        return answer(*health.healthz(), metrics.healthz_total)

    def plain(code: int, body: dict[str, object]) -> web.Response:
        return web.Response(
            status=code,
            text=json.dumps(body),
            content_type="application/json",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def readyz(_: web.Request) -> web.Response:
        return plain(*health.readyz())

    async def alivez(_: web.Request) -> web.Response:
        return plain(*health.alivez())

    def answer(code: int, body: dict[str, object], counter: Counter) -> web.Response:
        counter.labels(str(code)).inc()
        return plain(code, body)

    async def livez(_: web.Request) -> web.Response:
        return answer(*health.livez(), metrics.livez_total)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/alivez", alivez)
    return app


def metrics_app(
    registry: CollectorRegistry, before: Callable[[], None], mode: Callable[[], str]
) -> web.Application:
    """/metrics, and /proxyMode: the mode the agent programs, as text, as upstream serves it
    on its metrics address (sig-network's "should check kube-proxy urls" reads it)."""

    async def metrics(_: web.Request) -> web.Response:
        before()
        # In a worker thread: a collector may ask the kernel (iptables rule counters).
        body = await asyncio.to_thread(generate_latest, registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def proxy_mode(_: web.Request) -> web.Response:
        return web.Response(text=mode(), headers={"X-Content-Type-Options": "nosniff"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/proxyMode", proxy_mode)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


class RetryingServer:
    """`app` on host:port, bound as soon as the address is free: while another process holds
    it (upstream kube-proxy on the same node until a takeover moved it off, its healthz on
    0.0.0.0:10256 and metrics on 127.0.0.1:10249 as ours by default), a warning, then a new
    try every `retry` seconds in the background, as upstream kube-proxy does. Any other bind
    error is raised by `start`."""

    def __init__(
        self, app: web.Application, host: str, port: int, what: str, retry: float = BIND_RETRY
    ) -> None:
        self.app, self.host, self.port, self.what, self.retry = app, host, port, what, retry
        self.runner: web.AppRunner | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def serving(self) -> bool:
        return self.runner is not None

    async def _try(self) -> bool:
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as err:
            await runner.cleanup()
            if err.errno != errno.EADDRINUSE:
                raise
            return False
        self.runner = runner
        return True

    async def start(self) -> None:
        if await self._try():
            return
        log.warning(
            "%s: %s:%d is in use (upstream kube-proxy?), retrying every %.0fs",
            self.what,
            self.host,
            self.port,
            self.retry,
        )
        self._task = asyncio.create_task(self._retry_loop())

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.retry)
            try:
                if await self._try():
                    log.info("%s: serving on %s:%d", self.what, self.host, self.port)
                    return
            except OSError as err:
                log.error("%s: cannot bind %s:%d: %s", self.what, self.host, self.port, err)

    async def cleanup(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.runner is not None:
            await self.runner.cleanup()
