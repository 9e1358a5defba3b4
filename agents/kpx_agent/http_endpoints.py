"""kube-proxy compatible health (/healthz, /livez) and metrics (/metrics) endpoints."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


@dataclass
class Health:
    """Healthy while the last successful sync is recent enough (kube-proxy's rule)."""

    last_success: Callable[[], float]
    timeout: Callable[[], float]
    started: float

    def status(self, now: float | None = None, live: bool = False) -> tuple[int, dict[str, str]]:
        now = time.time() if now is None else now
        last = self.last_success()
        fresh = last > 0 and now - last <= self.timeout()
        # Liveness gives a starting agent (no sync yet) the same grace before failing.
        starting = last == 0 and now - self.started <= self.timeout()
        ok = fresh or (live and starting)
        body = {
            "lastUpdated": _rfc3339(last) if last else "",
            "currentTime": _rfc3339(now),
        }
        return (200 if ok else 503), body


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def health_app(health: Health) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        code, body = health.status()
        return web.Response(status=code, text=json.dumps(body), content_type="application/json")

    async def livez(_: web.Request) -> web.Response:
        code, body = health.status(live=True)
        return web.Response(status=code, text=json.dumps(body), content_type="application/json")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
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
