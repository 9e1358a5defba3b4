"""kube-proxy compatible health (/healthz, /livez), readiness (/readyz, kpx's own) and metrics
(/metrics) endpoints."""

from __future__ import annotations

import json
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from .metrics import AgentMetrics
from .proxy_health import ProxyHealth


def health_app(health: ProxyHealth, metrics: AgentMetrics) -> web.Application:
    """/healthz and /livez over `health`, counted by status code as upstream does; /readyz
    (not counted: upstream has no such endpoint)."""

    def answer(code: int, body: dict[str, object], counter: Counter) -> web.Response:
        counter.labels(str(code)).inc()
        return web.Response(
            status=code,
            text=json.dumps(body),
            content_type="application/json",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def healthz(_: web.Request) -> web.Response:
        return answer(*health.healthz(), metrics.healthz_total)

    async def readyz(_: web.Request) -> web.Response:
        code, body = health.readyz()
        return web.Response(
            status=code,
            text=json.dumps(body),
            content_type="application/json",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def livez(_: web.Request) -> web.Response:
        return answer(*health.livez(), metrics.livez_total)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    return app


def metrics_app(registry: CollectorRegistry, before: Callable[[], None]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        before()
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
