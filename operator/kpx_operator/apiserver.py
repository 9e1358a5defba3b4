"""The operator's I/O edge to the apiserver (besides kopf's own watches and patches).

Everything the operator writes goes through `ApiServer.apply`: server-side apply (PATCH
application/apply-patch+yaml, fieldManager kpx-operator, force), which creates missing objects,
repairs hand edits of the fields the operator owns and leaves other fields alone. Reads,
deletes, the status write and the Lease calls of the leader election are here too, and the
credentials (kubeconfig or in-cluster) that kopf's login uses as well.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp
import yaml

from kpx_api.constants import GROUP, PLURAL, VERSION

from .names import FIELD_MANAGER

Obj = dict[str, Any]
SA_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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


# -- credentials ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """How to reach and authenticate to the apiserver; paths only (data is put in files)."""

    server: str
    ca_file: Path | None = None
    insecure: bool = False
    cert_file: Path | None = None
    key_file: Path | None = None
    token: str | None = None
    token_file: Path | None = None  # read on every request: projected tokens rotate

    def bearer(self) -> str | None:
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return self.token

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def _material(entry: Mapping[str, Any], key: str, base_dir: Path) -> Path | None:
    """A file holding `key` (a path) or `key-data` (base64) of a kubeconfig entry."""
    if entry.get(f"{key}-data"):
        fd, name = tempfile.mkstemp(prefix="kpx-operator-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(base64.b64decode(entry[f"{key}-data"]))
        return Path(name)
    if entry.get(key):
        path = Path(str(entry[key])).expanduser()
        return path if path.is_absolute() else base_dir / path
    return None


def from_kubeconfig(path: Path) -> Credentials:
    """The current context of a kubeconfig: client certificate, token or token file."""
    config = yaml.safe_load(path.read_text()) or {}
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts") or []}
    if not contexts:
        raise ValueError(f"{path}: no context")
    context = contexts.get(config.get("current-context")) or next(iter(contexts.values()))
    clusters = {c["name"]: c.get("cluster") or {} for c in config.get("clusters") or []}
    users = {u["name"]: u.get("user") or {} for u in config.get("users") or []}
    cluster = clusters[context["cluster"]]
    user = users.get(context.get("user"), {})
    base = path.parent
    token_file = user.get("tokenFile")
    return Credentials(
        server=str(cluster["server"]).rstrip("/"),
        ca_file=_material(cluster, "certificate-authority", base),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        cert_file=_material(user, "client-certificate", base),
        key_file=_material(user, "client-key", base),
        token=user.get("token"),
        token_file=(base / token_file) if token_file else None,
    )


def in_cluster() -> Credentials:
    """The pod's service account (KUBERNETES_SERVICE_HOST/PORT, the mounted token and CA)."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        raise ValueError("not in a cluster (no KUBERNETES_SERVICE_HOST): give --kubeconfig")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    # KPX_SERVICEACCOUNT_DIR: where the token is mounted when not at the standard path
    # (the agent honours the same variable).
    sa_dir = Path(os.environ.get("KPX_SERVICEACCOUNT_DIR", SA_DIR))
    return Credentials(
        f"https://{host}:{port}", ca_file=sa_dir / "ca.crt", token_file=sa_dir / "token"
    )


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
                connector=aiohttp.TCPConnector(ssl=self.creds.ssl_context(), limit=8),
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
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
        if (token := self.creds.bearer()) is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        try:
            async with self.session.request(
                method, self.creds.server + path, params=params, data=data, headers=headers
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise ApiError(0, "Unreachable", f"{method} {path}: {exc!r}") from exc
        try:
            payload: Obj = json.loads(raw) if raw else {}
        except ValueError:
            payload = {"message": raw[:300].decode(errors="replace")}
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
