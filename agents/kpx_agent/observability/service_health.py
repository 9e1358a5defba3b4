"""healthCheckNodePort servers for externalTrafficPolicy: Local Services, as kube-proxy serves
them: 200 with the local endpoint count while this node has local endpoints, 503 otherwise, so
load balancers send traffic only to nodes that can serve it locally. Shared by every mode."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from ..model.types import NodeLocalState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthTarget:
    namespace: str
    name: str
    local_endpoints: int


def health_targets(state: NodeLocalState) -> dict[int, HealthTarget]:
    """healthCheckNodePort -> the Service it reports on, with its local endpoint count.

    A dual-stack pod has an address per family: count per family and report the larger count
    (as upstream does), so one pod counts once. Only ready endpoints count, as upstream's
    LocalReadyEndpoints: a node whose local endpoints are all terminating (still serving, used
    as the fallback) answers 503, so load balancers move its traffic elsewhere.
    """
    names: dict[int, tuple[str, str]] = {}
    local: dict[tuple[int, int], set[str]] = {}
    for sp in state.services.values():
        port = sp.health_check_node_port
        if not port:
            continue
        names.setdefault(port, (sp.key.namespace, sp.key.name))
        local.setdefault((port, sp.family), set()).update(
            e.ip for e in sp.external_endpoints if e.local and sp.conditions_of(e.ip).ready
        )
    return {
        port: HealthTarget(
            ns, name, max(len(local.get((port, 4), ())), len(local.get((port, 6), ())))
        )
        for port, (ns, name) in names.items()
    }


def response(target: HealthTarget) -> tuple[int, dict[str, str], str]:
    body = json.dumps(
        {
            "service": {"namespace": target.namespace, "name": target.name},
            "localEndpoints": target.local_endpoints,
            "serviceProxyHealthy": True,
        }
    )
    headers = {
        "Content-Type": "application/json",
        "X-Content-Type-Options": "nosniff",
        "X-Load-Balancing-Endpoint-Weight": str(target.local_endpoints),
    }
    return (200 if target.local_endpoints > 0 else 503), headers, body


class HealthCheckServers:
    """One HTTP server per healthCheckNodePort, opened and closed as Services come and go."""

    def __init__(self) -> None:
        self.targets: dict[int, HealthTarget] = {}
        self._runners: dict[int, web.AppRunner] = {}

    async def update(self, targets: Mapping[int, HealthTarget]) -> None:
        self.targets = dict(targets)
        for port in [p for p in self._runners if p not in targets]:
            await self._runners.pop(port).cleanup()
        for port in targets:
            if port not in self._runners:
                try:
                    self._runners[port] = await self._serve(port)
                except OSError as exc:
                    log.error("cannot serve healthCheckNodePort %d: %s", port, exc)

    async def _serve(self, port: int) -> web.AppRunner:
        async def handle(_: web.Request) -> web.Response:
            target = self.targets.get(port)
            if target is None:
                return web.Response(status=404)
            status, headers, body = response(target)
            return web.Response(status=status, headers=headers, text=body)

        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, None, port).start()
        return runner

    async def close(self) -> None:
        await self.update({})
