"""The operator's I/O edge to the apiserver (besides kopf's own watches and patches).

Everything the operator writes goes through `ApiServer.apply`: server-side apply (PATCH
application/apply-patch+yaml, fieldManager kpx-operator, force), which creates missing objects,
repairs hand edits of the fields the operator owns and leaves other fields alone. Reads,
deletes, the status write and the Lease calls of the leader election are here too.
Credentials (kubeconfig with exec plugins, or in-cluster) come from kpx_kube; kopf's login
handler uses the same `Credentials` object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from kpx_api.constants import GROUP, PLURAL, VERSION
from kpx_kube import Credentials, ExecPluginError, KubeconfigError, from_kubeconfig, in_cluster
from kpx_kube.tcp import socket_factory

from .names import FIELD_MANAGER

__all__ = ["ApiError", "ApiServer", "Applied", "Credentials", "from_kubeconfig", "in_cluster"]

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API."""

    prefix: str  # /api/v1 or /apis/<group>/<version>
    plural: str
    namespaced: bool


#: Every kind the operator reads or writes (no RBAC kinds: the agents' ServiceAccount, role and
#: binding are installed with the operator, which may not touch any role or binding).
KINDS: Final[dict[str, Kind]] = {
    "ConfigMap": Kind("/api/v1", "configmaps", True),
    "Pod": Kind("/api/v1", "pods", True),
    "Event": Kind("/api/v1", "events", True),
    "DaemonSet": Kind("/apis/apps/v1", "daemonsets", True),
    "Lease": Kind("/apis/coordination.k8s.io/v1", "leases", True),
    "ProxyConfiguration": Kind(f"/apis/{GROUP}/{VERSION}", PLURAL, False),
}


def object_path(kind: str, name: str | None = None, namespace: str | None = None) -> str:
    k = KINDS[kind]
    base = k.prefix
    if k.namespaced:
        if not namespace:
            raise ValueError(f"{kind} is namespaced: a namespace is needed")
        base += f"/namespaces/{namespace}"
    return f"{base}/{k.plural}" + (f"/{name}" if name else "")


class ApiError(RuntimeError):
    """The apiserver refused a request (status 0: it could not be reached)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{reason} ({status}): {message}" if status else message)
        self.status = status
        self.reason = reason
        self.message = message


# -- the client ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """The object as the apiserver returned it after an apply."""

    obj: Obj
    created: bool  # 201: the object did not exist before


class ApiServer:
    """A small async REST client: apply, get, delete, status patch, create/replace (Leases)."""

    def __init__(self, creds: Credentials, *, timeout: float = 30.0) -> None:
        self.creds = creds
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    ssl=self.creds.ssl_context, limit=8, socket_factory=socket_factory
                ),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> tuple[int, Obj]:
        """One request; returns (status, JSON body); raises ApiError unless 2xx."""
        try:
            auth = await self.creds.auth()
        except (OSError, ExecPluginError, KubeconfigError) as exc:  # token file, exec plugin
            raise ApiError(0, "Unauthenticated", f"{method} {path}: credentials: {exc}") from exc
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER, **auth.headers()}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            async with self.session.request(
                method,
                self.creds.server + path,
                params=params,
                data=data,
                headers=headers,
                ssl=auth.ssl,
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise ApiError(0, "Unreachable", f"{method} {path}: {exc!r}") from exc
        try:
            payload: Obj = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"message": raw[:300].decode(errors="replace")}
        if status == 401:  # an exec plugin's credential is run again for the next request
            self.creds.invalidate(auth)
        if not 200 <= status < 300:
            raise ApiError(status, str(payload.get("reason") or "Error"),
                           str(payload.get("message") or payload))  # fmt: skip
        return status, payload

    async def apply(self, obj: Mapping[str, Any]) -> Applied:
        """Server-side apply `obj` as kpx-operator, taking over conflicting fields (force)."""
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), meta["name"], meta.get("namespace"))
        status, out = await self.request(
            "PATCH",
            path,
            body=obj,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content_type="application/apply-patch+yaml",  # JSON is YAML
        )
        return Applied(out, created=status == 201)

    async def get(self, kind: str, name: str, namespace: str | None = None) -> Obj | None:
        """The object, or None when it does not exist."""
        try:
            return (await self.request("GET", object_path(kind, name, namespace)))[1]
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[Obj]:
        """The items of a list (one page: the operator lists only its own namespace's few)."""
        params = {k: v for k, v in (("labelSelector", label_selector),
                                    ("fieldSelector", field_selector)) if v}  # fmt: skip
        _, out = await self.request("GET", object_path(kind, None, namespace), params=params)
        return list(out.get("items") or [])

    async def delete(
        self,
        kind: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str = "Background",
    ) -> bool:
        """Delete; True when the object existed (and is now gone or going)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        try:
            await self.request("DELETE", object_path(kind, name, namespace), body=body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def patch_status(self, kind: str, name: str, status: Mapping[str, Any]) -> Obj:
        """JSON merge patch of .status through the status subresource."""
        path = object_path(kind, name) + "/status"
        body = {"status": dict(status)}
        return (await self.request("PATCH", path, body=body,
                                   content_type="application/merge-patch+json"))[1]  # fmt: skip

    async def create(self, obj: Mapping[str, Any]) -> Obj:
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), None, meta.get("namespace"))
        return (await self.request("POST", path, body=obj))[1]

    async def replace(self, obj: Mapping[str, Any]) -> Obj:
        """PUT: fails with 409 Conflict when metadata.resourceVersion is stale."""
        meta = obj["metadata"]
        path = object_path(str(obj["kind"]), meta["name"], meta.get("namespace"))
        return (await self.request("PUT", path, body=obj))[1]
