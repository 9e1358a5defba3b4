"""The agent's Kubernetes I/O edge: a small async REST client (list, watch) over aiohttp.

JSON stays plain dicts (no generated model classes: at tens of thousands of objects their cost
shows). Every byte and object received is counted, per resource, for the metrics. Credentials
(kubeconfig, exec plugins, in-cluster) and the connections' TCP keepalive come from kpx_kube.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from kpx_kube import Auth, Credentials, KubeconfigError, from_kubeconfig, in_cluster
from kpx_kube.exec_plugin import ExecPluginError
from kpx_kube.tcp import socket_factory

from . import collector

__all__ = ["ApiError", "Credentials", "KubeClient", "WatchIdle", "from_kubeconfig", "in_cluster"]

log = logging.getLogger(__name__)


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class WatchIdle(TimeoutError):
    """No byte arrived on a watch for its idle timeout: the connection may be half-open."""


# A healthy watch on a resource that changes hears a bookmark about every 60 s
# (kube-apiserver's cacher, defaultBookmarkFrequency); one on a resource with no write at all
# hears nothing until the server ends it. 90 s: one missed bookmark plus margin.
DEFAULT_WATCH_IDLE_TIMEOUT = 90.0


class KubeClient:
    """list and watch on the apiserver; counts bytes and objects received per resource.

    `watch_idle_timeout`: a watch that receives no byte for that many seconds is dropped
    (`WatchIdle`), so a half-open connection cannot freeze the agent's view."""

    def __init__(
        self, creds: Credentials, watch_idle_timeout: float = DEFAULT_WATCH_IDLE_TIMEOUT
    ) -> None:
        self.creds = creds
        self.watch_idle_timeout = watch_idle_timeout
        self.bytes_received: Counter[str] = Counter()
        self.objects_received: Counter[str] = Counter()
        self.watch_idle_timeouts: Counter[str] = Counter()
        self._session: aiohttp.ClientSession | None = None

    def _headers(self, auth: Auth) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "kpx-agent", **auth.headers()}
        if not self.creds.compression:
            headers["Accept-Encoding"] = "identity"
        return headers

    async def _auth(self) -> Auth:
        try:
            return await self.creds.auth()
        except (OSError, ExecPluginError, KubeconfigError) as exc:  # token file, exec plugin
            raise ApiError(0, f"credentials: {exc}") from exc

    def _refused(self, status: int, body: bytes, auth: Auth) -> ApiError:
        if status == 401:  # an exec plugin's credential is run again for the next request
            self.creds.invalidate(auth)
        return ApiError(status, body[:500].decode(errors="replace"))

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    ssl=self.creds.ssl_context, limit=16, socket_factory=socket_factory
                ),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST `body` to `path` (an object the agent records, such as an Event)."""
        auth = await self._auth()
        async with self.session.post(
            self.creds.server + path,
            json=dict(body),
            headers=self._headers(auth),
            timeout=aiohttp.ClientTimeout(total=10),
            ssl=auth.ssl,
        ) as resp:
            data = await resp.read()
            if resp.status >= 300:
                raise self._refused(resp.status, data, auth)
            created: dict[str, Any] = orjson.loads(data)
            return created

    async def list(self, resource: str, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        url = self.creds.server + path
        timeout = aiohttp.ClientTimeout(total=120)
        started = time.monotonic()
        auth = await self._auth()
        async with self.session.get(
            url,
            params=dict(params),
            headers=self._headers(auth),
            timeout=timeout,
            ssl=auth.ssl,
        ) as resp:
            body = await resp.read()
            self.bytes_received[resource] += len(body)
            if resp.status != 200:
                raise self._refused(resp.status, body, auth)
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
        self,
        resource: str,
        path: str,
        params: Mapping[str, str],
    ) -> AsyncIterator[dict[str, Any]]:
        """Yield watch events ({type, object}) until the server ends the watch; raise
        WatchIdle when no byte arrives for `watch_idle_timeout` seconds."""
        url = self.creds.server + path
        idle = self.watch_idle_timeout
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=idle)
        auth = await self._auth()
        async with self.session.get(
            url,
            params={**params, "watch": "1"},
            headers=self._headers(auth),
            timeout=timeout,
            ssl=auth.ssl,
        ) as resp:
            if resp.status != 200:
                raise self._refused(resp.status, await resp.read(), auth)
            # One JSON document per line; lines can be large (a big EndpointSlice), so split
            # the stream ourselves rather than use the reader's bounded readline().
            pending = b""
            chunks = resp.content.iter_any()
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    return
                except TimeoutError:  # aiohttp's sock_read: no byte for `idle` seconds
                    self.watch_idle_timeouts[resource] += 1
                    raise WatchIdle(f"no byte for {idle:g} s") from None
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
