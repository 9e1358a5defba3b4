"""The agent's Kubernetes I/O edge: a small async REST client (list, watch) over aiohttp.

JSON stays plain dicts (no generated model classes: at tens of thousands of objects their cost
shows). Every byte and object received is counted, per resource, for the metrics.
"""

from __future__ import annotations

import base64
import logging
import os
import ssl
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from . import collector

log = logging.getLogger(__name__)
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class Credentials:
    server: str
    ssl_context: ssl.SSLContext
    token: str | None = None
    token_file: Path | None = None
    # The kubeconfig's `disable-compression` (as client-go): ask for uncompressed responses,
    # which on a fast network saves the apiserver's and the agent's CPU on big lists.
    compression: bool = True

    def bearer(self) -> str | None:
        if self.token_file is not None:
            # Projected tokens rotate: read the file each time (it is small and cached by the OS).
            return self.token_file.read_text().strip()
        return self.token


def _material(entry: Mapping[str, Any], key: str, base_dir: Path) -> Path | None:
    """A file holding `key` (path) or `key-data` (base64) of a kubeconfig entry."""
    if entry.get(f"{key}-data"):
        fd, name = tempfile.mkstemp(prefix="kpx-kubeconfig-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(base64.b64decode(entry[f"{key}-data"]))
        return Path(name)
    if entry.get(key):
        path = Path(str(entry[key]))
        return path if path.is_absolute() else base_dir / path
    return None


def from_kubeconfig(path: Path) -> Credentials:
    config = yaml.safe_load(path.read_text())
    context_name = config.get("current-context")
    contexts = {c["name"]: c["context"] for c in config.get("contexts") or []}
    context = contexts.get(context_name) or next(iter(contexts.values()))
    cluster = {c["name"]: c["cluster"] for c in config["clusters"]}[context["cluster"]]
    user = {u["name"]: u["user"] for u in config.get("users") or []}.get(context.get("user"), {})
    base = path.parent
    ca = _material(cluster, "certificate-authority", base)
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cluster.get("insecure-skip-tls-verify"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    cert, key = _material(user, "client-certificate", base), _material(user, "client-key", base)
    if cert and key:
        ctx.load_cert_chain(cert, key)
    token_file = Path(user["tokenFile"]) if user.get("tokenFile") else None
    return Credentials(
        str(cluster["server"]).rstrip("/"),
        ctx,
        user.get("token"),
        token_file,
        compression=not cluster.get("disable-compression", False),
    )


def in_cluster() -> Credentials:
    """The pod's service-account credentials (KPX_SERVICEACCOUNT_DIR overrides the path)."""
    sa = Path(os.environ.get("KPX_SERVICEACCOUNT_DIR", SA_DIR))
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    ctx = ssl.create_default_context(cafile=str(sa / "ca.crt"))
    return Credentials(f"https://{host}:{port}", ctx, token_file=sa / "token")


class KubeClient:
    """list and watch on the apiserver; counts bytes and objects received per resource."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self.bytes_received: Counter[str] = Counter()
        self.objects_received: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "kpx-agent"}
        if not self.creds.compression:
            headers["Accept-Encoding"] = "identity"
        if (token := self.creds.bearer()) is not None:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.creds.ssl_context, limit=16),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def list(self, resource: str, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        url = self.creds.server + path
        timeout = aiohttp.ClientTimeout(total=120)
        started = time.monotonic()
        async with self.session.get(
            url, params=dict(params), headers=self._headers(), timeout=timeout
        ) as resp:
            body = await resp.read()
            self.bytes_received[resource] += len(body)
            if resp.status != 200:
                raise ApiError(resp.status, body[:500].decode(errors="replace"))
            received = time.monotonic()
            with collector.paused():  # about a million acyclic containers at 10,000
                data: dict[str, Any] = orjson.loads(body)
            log.debug(
                "%s: %d bytes (%s) received in %.3f s, decoded in %.3f s",
                resource,
                len(body),
                resp.headers.get("Content-Encoding", "identity"),
                received - started,
                time.monotonic() - received,
            )
            self.objects_received[resource] += len(data.get("items") or [])
            return data

    async def watch(
        self, resource: str, path: str, params: Mapping[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield watch events ({type, object}) until the server ends the watch."""
        url = self.creds.server + path
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
        async with self.session.get(
            url, params={**params, "watch": "1"}, headers=self._headers(), timeout=timeout
        ) as resp:
            if resp.status != 200:
                body = await resp.read()
                raise ApiError(resp.status, body[:500].decode(errors="replace"))
            # One JSON document per line; lines can be large (a big EndpointSlice), so split
            # the stream ourselves rather than use the reader's bounded readline().
            pending = b""
            async for chunk in resp.content.iter_any():
                self.bytes_received[resource] += len(chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event: dict[str, Any] = orjson.loads(line)
                    if event.get("type") != "BOOKMARK":
                        self.objects_received[resource] += 1
                    yield event
