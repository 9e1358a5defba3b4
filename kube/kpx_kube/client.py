"""The one HTTP client of the apiserver (aiohttp): requests, server-side apply, list, watch.

JSON stays plain dicts (no generated model classes: at tens of thousands of objects their
cost shows) and is decoded with orjson. Every answer that is not 2xx raises the `ApiError`
of its status (`errors`); a request that gets no answer raises `Unreachable`, so callers
catch one hierarchy and never the transport's exceptions.

`list` and `watch` are the reflector's fast path: a big list is read whole and decoded with
the cyclic garbage collector paused (about a million acyclic containers at 10,000 Services);
a watch's stream is split into lines by hand (a line can be bigger than aiohttp's readline
buffer), and a watch that receives no byte for `watch_idle_timeout` seconds raises
`WatchIdle` (a half-open connection). Bytes and objects received are counted per resource,
for metrics, and every request is told to `observer` (method, host, status code or
"<error>", seconds to the answer's headers and body; a watch's to its headers), as client-go
tells its rest_client_* metrics. Connections carry TCP keepalive and a user timeout (`tcp`).

A 401 makes the credentials run their exec plugin again for the next request.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import aiohttp
import orjson

from . import collector, request
from .credentials import Auth, Credentials
from .errors import (
    ApiError,
    NotFound,
    Unreachable,
    WatchIdle,
    from_response,
    from_status,
    retry_after,
)
from .exec_plugin import ExecPluginError
from .kinds import BUILTIN, prefix_of
from .kubeconfig import KubeconfigError
from .list_body import ListBody
from .tcp import socket_factory
from .watch_events import BadList, decode_json, decode_line

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# A healthy watch on a resource that changes hears a bookmark about every 60 s
# (kube-apiserver's cacher, defaultBookmarkFrequency); one on a resource with no write at all
# hears nothing until the server ends it. 90 s: one missed bookmark plus margin.
DEFAULT_WATCH_IDLE_TIMEOUT = 90.0


class Reply(NamedTuple):
    status: int  # 200, or 201 when the request created the object
    body: Obj


class Client:
    """Requests to one apiserver with one identity. The aiohttp session is made on first use
    (so a client may be built outside the event loop that uses it, and must stay on it)."""

    def __init__(
        self,
        creds: Credentials,
        *,
        user_agent: str = "kpx",
        timeout: float = 30.0,
        watch_idle_timeout: float = DEFAULT_WATCH_IDLE_TIMEOUT,
        connections: int = 16,
    ) -> None:
        self.creds = creds
        self.user_agent = user_agent
        self.timeout = timeout
        self.watch_idle_timeout = watch_idle_timeout
        self.connections = connections
        self.bytes_received: Counter[str] = Counter()
        self.objects_received: Counter[str] = Counter()
        self.watch_idle_timeouts: Counter[str] = Counter()
        self.requests_sent = 0  # every request, list page and watch
        self.connections_opened = 0  # TCP connections (each one's socket is made here)
        self._session: aiohttp.ClientSession | None = None
        #: Told of every request: (method, host, status code or "<error>", seconds).
        self.observer: Callable[[str, str, str, float], None] | None = None
        self._kinds: dict[tuple[str, str], tuple[str, bool]] = {
            (k.prefix, k.kind): (k.plural, k.namespaced) for k in BUILTIN.values()
        }

    @property
    def server(self) -> str:
        return self.creds.server

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    ssl=self.creds.ssl_context,
                    limit=self.connections,
                    socket_factory=self._socket,
                ),
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
            )
        return self._session

    def _socket(self, addr_info: tuple[Any, ...]) -> socket.socket:
        self.connections_opened += 1
        return socket_factory(addr_info)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _observe(self, method: str, started: float, status: int | None) -> None:
        if self.observer is not None:
            host = urlsplit(self.creds.server).netloc
            code = "<error>" if status is None else str(status)
            self.observer(method, host, code, time.monotonic() - started)

    async def _auth(self) -> Auth:
        try:
            return await self.creds.auth()
        except (OSError, ExecPluginError, KubeconfigError) as exc:  # token file, exec plugin
            raise Unreachable(f"credentials: {exc}", "Unauthenticated") from exc

    def _build(self, method: str, path: str, auth: Auth, **kw: Any) -> request.Request:
        self.requests_sent += 1
        return request.build(
            method,
            path,
            user_agent=self.user_agent,
            token=auth.token,
            compression=self.creds.compression,
            **kw,
        )

    def _refused(
        self, req: request.Request, status: int, body: bytes, auth: Auth, wait: str | None
    ) -> ApiError:
        """The error of an answer that is not 2xx (`wait`: its Retry-After header)."""
        if status == 401:  # an exec plugin's credential is run again for the next request
            self.creds.invalidate(auth)
        return from_response(status, body, req.what, retry_after(status, wait))

    # -- requests -----------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content: str = "json",
        timeout: float | None = None,
    ) -> Reply:
        """One request; its status and decoded JSON answer. Raises the ApiError of a non-2xx
        status, or Unreachable."""
        auth = await self._auth()
        req = self._build(method, path, auth, params=params, body=body, content=content)
        started = time.monotonic()
        try:
            async with self.session.request(
                req.method,
                self.creds.server + req.path,
                params=req.params,
                data=req.data,
                headers=req.headers,
                timeout=aiohttp.ClientTimeout(total=timeout or self.timeout),
                ssl=auth.ssl,
            ) as resp:
                raw = await resp.read()
                status, wait = resp.status, resp.headers.get("Retry-After")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._observe(req.method, started, None)
            raise Unreachable(f"{req.what}: {exc!r}") from exc
        self._observe(req.method, started, status)
        if not 200 <= status < 300:
            raise self._refused(req, status, raw, auth, wait)
        try:
            doc = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError as exc:
            raise ApiError(status, "BadResponse", f"{req.what}: not JSON: {exc}") from exc
        return Reply(status, doc if isinstance(doc, dict) else {"items": doc})

    async def ready(self, timeout: float = 2.0) -> bool:
        """The apiserver answers `/readyz` with 200 (it serves, etcd included); any client
        may read it (system:public-info-viewer). False on any other answer or none."""
        auth = await self._auth()
        req = self._build("GET", "/readyz", auth)
        started = time.monotonic()
        try:
            async with self.session.request(
                req.method,
                self.creds.server + req.path,
                headers=req.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                ssl=auth.ssl,
            ) as resp:
                await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError):
            self._observe(req.method, started, None)
            return False
        self._observe(req.method, started, status)
        return status == 200

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> Obj:
        return (await self.request("GET", path, params=params)).body

    async def get_or_none(self, path: str) -> Obj | None:
        """GET; None when it does not exist."""
        try:
            return await self.get(path)
        except NotFound:
            return None

    async def create(self, path: str, body: Mapping[str, Any]) -> Obj:
        """POST `body` to the collection `path`; AlreadyExists if the name is taken."""
        return (await self.request("POST", path, body=dict(body))).body

    async def replace(self, path: str, body: Mapping[str, Any]) -> Obj:
        """PUT; Conflict when metadata.resourceVersion is stale."""
        return (await self.request("PUT", path, body=dict(body))).body

    async def patch(self, path: str, body: Any, *, patch: str = "merge") -> Obj:
        """PATCH with `patch` one of merge, strategic, json-patch."""
        if patch == "apply":
            raise ValueError("use apply() for server-side apply")
        return (await self.request("PATCH", path, body=body, content=patch)).body

    async def patch_status(self, path: str, status: Mapping[str, Any]) -> Obj:
        """A JSON merge patch of .status through the object's status subresource."""
        return await self.patch(path + "/status", {"status": dict(status)})

    async def apply(
        self,
        path: str,
        obj: Mapping[str, Any],
        *,
        field_manager: str,
        force: bool = True,
        dry_run: bool = False,
    ) -> Reply:
        """Server-side apply `obj` at the object path `path` as `field_manager`; with `force`
        it takes over fields other managers own (else Conflict). Status 201: created."""
        params = request.apply_params(field_manager, force=force, dry_run=dry_run)
        return await self.request("PATCH", path, body=dict(obj), params=params, content="apply")

    async def delete(
        self, path: str, *, propagation: str = "Background", missing_ok: bool = False
    ) -> bool:
        """DELETE; True when the object existed (and is gone or going). With `missing_ok`
        a missing object is False, else NotFound."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        try:
            await self.request("DELETE", path, body=body)
        except NotFound:
            if missing_ok:
                return False
            raise
        return True

    # -- where a kind lives (discovery) -------------------------------------------------------

    async def kind_path(self, api_version: str, kind: str) -> tuple[str, str, bool]:
        """(prefix, plural, namespaced) of a kind: kinds.BUILTIN's, else from the apiserver's
        discovery (cached)."""
        prefix = prefix_of(api_version)
        key = (prefix, kind)
        if key not in self._kinds:
            found = await self.get(prefix)
            for res in found.get("resources") or []:
                name = str(res.get("name", ""))
                if "/" not in name:  # not a subresource
                    self._kinds[(prefix, str(res.get("kind")))] = (name, bool(res["namespaced"]))
            if key not in self._kinds:
                raise NotFound(404, "NotFound", f"{api_version} serves no kind {kind}")
        plural, namespaced = self._kinds[key]
        return prefix, plural, namespaced

    async def path_of(self, obj: Mapping[str, Any], *, collection: bool = False) -> str:
        """The REST path of `obj` (by its apiVersion, kind, metadata.name and .namespace)."""
        prefix, plural, namespaced = await self.kind_path(str(obj["apiVersion"]), str(obj["kind"]))
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") or ("default" if namespaced else None)
        name = None if collection else str(meta["name"])
        return request.object_path(prefix, plural, name, namespace if namespaced else None)

    async def apply_object(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True
    ) -> Reply:
        """Server-side apply of an object of any kind the apiserver serves."""
        return await self.apply(
            await self.path_of(obj), obj, field_manager=field_manager, force=force
        )

    # -- the reflector's fast path ------------------------------------------------------------

    async def list(
        self,
        resource: str,
        path: str,
        params: Mapping[str, str],
        *,
        timeout: float = 120.0,
        item: Callable[[dict[str, Any]], Any] | None = None,
    ) -> Any:
        """One page of a list, decoded with the collector paused; counted under `resource`.
        BadList when it is not JSON (its shape is checked by watch_events.decode_list).
        With `item`, each item is decoded as soon as it has arrived and replaced by `item`'s
        result (list_body: neither the whole body nor the page's whole tree is ever held);
        what `item` raises goes to the caller."""
        started = time.monotonic()
        auth = await self._auth()
        req = self._build("GET", path, auth, params=params)
        body = b""
        decoder = ListBody(item) if item is not None else None
        try:
            async with self.session.get(
                self.creds.server + req.path,
                params=req.params,
                headers=req.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
                ssl=auth.ssl,
            ) as resp:
                status, encoding = resp.status, resp.headers.get("Content-Encoding", "identity")
                wait = resp.headers.get("Retry-After")
                if status != 200 or decoder is None:
                    body = await resp.read()
                else:
                    with collector.paused():
                        try:
                            async for chunk in resp.content.iter_any():
                                decoder.feed(chunk)
                        except (TimeoutError, aiohttp.ClientError, OSError):
                            raise
                        except Exception:  # `item` refused an item: the answer still counts
                            self._observe("GET", started, status)
                            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._observe("GET", started, None)
            raise Unreachable(f"{req.what}: {exc!r}") from exc
        self._observe("GET", started, status)
        size = len(body) if decoder is None or status != 200 else decoder.size
        self.bytes_received[resource] += size
        if status != 200:
            raise self._refused(req, status, body, auth, wait)
        received = time.monotonic()
        with collector.paused():
            if decoder is None:
                data = decode_json(body, f"{req.what}: a list answer", BadList)
            else:
                try:
                    data = decoder.finish()
                except orjson.JSONDecodeError as exc:
                    raise BadList(f"{req.what}: a list answer that is not JSON ({exc})") from None
        del body
        log.debug(
            "%s: %d bytes (%s) received%s in %.3f s, decoded %.3f s after",
            resource,
            size,
            encoding,
            "" if decoder is None else " and decoded item by item",
            received - started,
            time.monotonic() - received,
        )
        items = data.get("items") if isinstance(data, dict) else None
        self.objects_received[resource] += len(items) if isinstance(items, list) else 0
        return data  # its shape: watch_events.decode_list

    async def watch(
        self, resource: str, path: str, params: Mapping[str, str]
    ) -> AsyncIterator[Any]:
        """Watch events ({type, object}) until the server ends the watch. Raises WatchIdle
        after `watch_idle_timeout` seconds without a byte, Unreachable on a broken stream,
        the ApiError of the status if the watch is refused. A watch's ERROR event is yielded
        as it came (see `event_error`)."""
        idle = self.watch_idle_timeout
        auth = await self._auth()
        req = self._build("GET", path, auth, params={**params, "watch": "1"})
        started = time.monotonic()
        answered = False
        try:
            async with self.session.get(
                self.creds.server + req.path,
                params=req.params,
                headers=req.headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=idle),
                ssl=auth.ssl,
            ) as resp:
                answered = True
                self._observe("GET", started, resp.status)
                if resp.status != 200:
                    body = await resp.read()
                    wait = resp.headers.get("Retry-After")
                    raise self._refused(req, resp.status, body, auth, wait)
                # One JSON document per line; lines can be large (a big EndpointSlice), so
                # split the stream here rather than use the reader's bounded readline().
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
                        event = decode_line(line)  # its shape: watch_events.decode_event
                        if not isinstance(event, dict) or event.get("type") != "BOOKMARK":
                            self.objects_received[resource] += 1
                        yield event
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            if not answered:
                self._observe("GET", started, None)
            raise Unreachable(f"{req.what} (watch): {exc!r}") from exc


def login_session(auth: Auth, *, connections: int = 0) -> aiohttp.ClientSession:
    """An aiohttp session that authenticates as `auth` (its SSL context, built in memory,
    and bearer token), on keepalive-tuned connections: for a library that makes its own
    requests with a session it is given (kopf's login)."""
    connector = aiohttp.TCPConnector(limit=connections, ssl=auth.ssl, socket_factory=socket_factory)
    return aiohttp.ClientSession(connector=connector, headers=auth.headers())


def event_error(event: Mapping[str, Any]) -> ApiError | None:
    """The error a watch's ERROR event carries (a metav1.Status; Gone for 410), else None."""
    if event.get("type") != "ERROR":
        return None
    return from_status(event.get("object") or {})
