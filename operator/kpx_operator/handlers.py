"""The kopf handlers: a few lines each, on an explicit registry (no import side effects).

- indices of the Nodes (name -> labels) and of the ProxyConfigurations (for conflicts);
- on a spec change, and on a timer (drift repair, status refresh): `Reconciler.reconcile`;
- on deletion (kopf holds the finalizer meanwhile): `Reconciler.finalize`;
- login: the operator's own credentials (kubeconfig or in-cluster), shared with the apply edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from kpx_api.constants import GROUP, PLURAL, VERSION

from .admission import PxcInfo
from .apiserver import Credentials
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


def register(
    registry: kopf.OperatorRegistry,
    reconciler: Reconciler,
    credentials: Credentials,
    *,
    namespace: str,
    resync_interval: float = 10.0,
) -> None:
    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # Called again when the apiserver answers 401: a rotated token file is re-read.
        return kopf.ConnectionInfo(
            server=credentials.server,
            ca_path=str(credentials.ca_file) if credentials.ca_file else None,
            insecure=credentials.insecure or None,
            certificate_path=str(credentials.cert_file) if credentials.cert_file else None,
            private_key_path=str(credentials.key_file) if credentials.key_file else None,
            token=credentials.bearer(),
            # Events about cluster-scoped ProxyConfigurations go to the operator's namespace.
            default_namespace=namespace,
        )

    @kopf.index("nodes", id=NODE_INDEX, registry=registry)
    def kpx_nodes(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, dict[str, str]]:
        return {name: dict(labels)}

    @kopf.index(*PXC, id=PXC_INDEX, registry=registry)
    def kpx_configs(name: str, body: kopf.Body, **_: Any) -> dict[str, PxcInfo]:
        return {name: PxcInfo.from_body(body)}

    async def reconcile(body: kopf.Body, **kwargs: Any) -> None:
        await reconciler.reconcile(
            body, _pxcs(kwargs[PXC_INDEX]), _nodes(kwargs[NODE_INDEX]), _emitter(body)
        )

    kopf.on.update(*PXC, id="reconcile", field="spec", registry=registry)(reconcile)
    kopf.timer(*PXC, id="resync", interval=resync_interval, registry=registry)(reconcile)

    @kopf.on.delete(*PXC, id="cleanup", registry=registry)
    async def cleanup(body: kopf.Body, runtime: Any, **kwargs: Any) -> None:
        try:
            await reconciler.finalize(
                body,
                _pxcs(kwargs[PXC_INDEX]),
                _nodes(kwargs[NODE_INDEX]),
                runtime.total_seconds(),
                _emitter(body),
            )
        except NotYet as wait:
            raise kopf.TemporaryError(str(wait), delay=wait.delay) from None
