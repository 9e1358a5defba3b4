"""The node simulator's Kubernetes client: a small async REST client over aiohttp.

Each simulated kubelet talks to the apiserver with its node's own client certificate (user
``system:node:<name>``, group ``system:nodes``), so the Node authorizer and the NodeRestriction
admission plugin judge every request exactly as they would a real kubelet's.
"""

from __future__ import annotations

import datetime
import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

Obj = dict[str, Any]
"""A Kubernetes object (or any JSON document) as plain dicts."""

PATCH_TYPES = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes `metav1.Time` (whole seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """The current UTC time as Kubernetes `metav1.MicroTime` (leases)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ApiError(RuntimeError):
    """The apiserver answered with an error status."""

    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        self.status = status
        self.method = method
        self.path = path
        try:
            doc = json.loads(body)
            self.reason = str(doc.get("reason", ""))
            self.detail = str(doc.get("message", ""))
        except ValueError:
            self.reason = ""
            self.detail = body[:300].decode(errors="replace")
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.detail}")


@dataclass(frozen=True)
class Credentials:
    """Where the apiserver is and the client certificate to present to it."""

    server: str
    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Credentials:
        """Read a single-context, file-based kubeconfig (as `write_kubeconfig` makes them)."""
        config = yaml.safe_load(path.read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        return cls(
            server=str(cluster["server"]).rstrip("/"),
            ca_file=Path(cluster["certificate-authority"]),
            cert_file=Path(user["client-certificate"]),
            key_file=Path(user["client-key"]),
        )

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


class KubeApi:
    """JSON requests and watches against one apiserver with one identity.

    The aiohttp session is created on first use, so the object may be built outside the event
    loop that later uses it (but must then stay on that loop).
    """

    def __init__(self, creds: Credentials, user_agent: str) -> None:
        self.creds = creds
        self.user_agent = user_agent
        self._ssl = creds.ssl_context()
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl, limit=8),
                headers={"Accept": "application/json", "User-Agent": self.user_agent},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Obj | None = None,
        patch: str | None = None,
        timeout: float = 30,
    ) -> Obj:
        """One request; the decoded JSON answer. Raises ApiError on a non-2xx status.

        `patch` ("merge" or "strategic") selects the patch content type for PATCH requests.
        """
        headers = {}
        data = None
        if body is not None:
            headers["Content-Type"] = PATCH_TYPES[patch] if patch else "application/json"
            data = json.dumps(body).encode()
        async with self.session.request(
            method,
            self.creds.server + path,
            params=dict(params or {}),
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            raw = await resp.read()
            if resp.status >= 300:
                raise ApiError(method, path, resp.status, raw)
            doc: Obj = json.loads(raw) if raw else {}
            return doc

    async def get_or_none(self, path: str) -> Obj | None:
        """GET `path`; None when it does not exist (404)."""
        try:
            return await self.request("GET", path)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        """Yield watch events ({type, object}) until the server ends the watch."""
        async with self.session.get(
            self.creds.server + path,
            params={**params, "watch": "1"},
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
        ) as resp:
            if resp.status != 200:
                raise ApiError("WATCH", path, resp.status, await resp.read())
            # One JSON document per line; split ourselves (readline() has a bounded buffer).
            pending = b""
            async for chunk in resp.content.iter_any():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        event: Obj = json.loads(line)
                        yield event
