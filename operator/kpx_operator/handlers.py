"""The kopf handlers: a few lines each, on an explicit registry (no import side effects).

- indices of the Nodes (name -> labels) and of the ProxyConfigurations (for conflicts);
- on a spec change, and on a timer (drift repair, status refresh): `Reconciler.reconcile`;
- on deletion (kopf holds the finalizer meanwhile): `Reconciler.finalize`;
- login: the operator's own credentials (kubeconfig with exec plugins, or in-cluster), shared
  with the apply edge, handed to kopf as an aiohttp session whose SSL context was built in
  memory (kopf's ConnectionInfo would write `*-data` keys to temporary files to load them).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from kpx_api.constants import GROUP, PLURAL, VERSION
from kpx_kube import Auth
from kpx_kube.client import login_session

from .admission import PxcInfo
from .apiserver import Credentials
from .metrics import OperatorMetrics
from .reconciler import EventFn, NotYet, Reconciler

PXC = (GROUP, VERSION, PLURAL)
NODE_INDEX = "kpx_nodes"
PXC_INDEX = "kpx_configs"


def _emitter(body: kopf.Body) -> EventFn:
    def emit(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message)

    return emit


def _nodes(index: kopf.Index[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    return {name: next(iter(store)) for name, store in index.items() if store}


def _pxcs(index: kopf.Index[str, PxcInfo]) -> list[PxcInfo]:
    return [info for store in index.values() for info in store]


def login_handler(
    credentials: Credentials, namespace: str
) -> Callable[..., Awaitable[kopf.AiohttpSession]]:
    """kopf's login: an aiohttp session with the SSL context built in memory and the token."""
    handed: list[Auth] = []  # what kopf was last given

    async def login(**_: Any) -> kopf.AiohttpSession:
        # kopf logs in at start, when `expiration` has passed, and when the apiserver refused
        # what it had (401): an exec plugin is then run again, a token file re-read.
        if handed:
            credentials.invalidate(handed.pop())
        auth = await credentials.auth()
        handed.append(auth)
        return kopf.AiohttpSession(
            server=credentials.server,
            aiohttp_session=login_session(auth),
            expiration=auth.expires,
            # Events about cluster-scoped ProxyConfigurations go to the operator's namespace.
            default_namespace=namespace,
        )

    return login


def register(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    credentials: Credentials,
    *,
    namespace: str,
    resync_interval: float = 10.0,
    metrics: OperatorMetrics | None = None,
) -> None:
    counted = metrics or OperatorMetrics()
    kopf.on.login(registry=registry)(login_handler(credentials, namespace))

    @kopf.index("nodes", id=NODE_INDEX, registry=registry)
    def kpx_nodes(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, dict[str, str]]:
        return {name: dict(labels)}

    @kopf.index(*PXC, id=PXC_INDEX, registry=registry)
    def kpx_configs(name: str, body: kopf.Body, **_: Any) -> dict[str, PxcInfo]:
        return {name: PxcInfo.from_body(body)}

    def reconcile_as(handler: str) -> Callable[..., Awaitable[None]]:
        async def reconcile(body: kopf.Body, **kwargs: Any) -> None:
            await counted.timed(
                handler,
                lambda: reconciler.reconcile(
                    body, _pxcs(kwargs[PXC_INDEX]), _nodes(kwargs[NODE_INDEX]), _emitter(body)
                ),
            )

        return reconcile

    kopf.on.update(*PXC, id="reconcile", field="spec", registry=registry)(reconcile_as("reconcile"))
    kopf.timer(*PXC, id="resync", interval=resync_interval, registry=registry)(
        reconcile_as("resync")
    )

    @kopf.on.delete(*PXC, id="cleanup", registry=registry)
    async def cleanup(body: kopf.Body, runtime: Any, **kwargs: Any) -> None:
        try:
            await counted.timed(
                "cleanup",
                lambda: reconciler.finalize(
                    body,
                    _pxcs(kwargs[PXC_INDEX]),
                    _nodes(kwargs[NODE_INDEX]),
                    runtime.total_seconds(),
                    _emitter(body),
                ),
                requeue=(NotYet,),
            )
        except NotYet as wait:
            raise kopf.TemporaryError(str(wait), delay=wait.delay) from None
