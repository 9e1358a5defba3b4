"""The gRPC edge of the node-local state API: a unix socket (or a loopback TCP port).

The socket is 0600, owned by the agent: only the agent's user (and root) can connect. Its
directory, when missing, is created 0750; an existing directory is used as it is (its mode is
never changed) unless it is shared (socket_directory.py), which is refused. The socket is bound
under a private name and renamed into place once its mode is set, so there is no moment where it
exists with a wider mode. A request that is not a WatchRequest is answered INVALID_ARGUMENT and
logged in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from kpx_localstate_client import WATCH_METHOD
from kpx_localstate_client import localstate_pb2 as pb

from .address import Listen
from .publisher import Publisher
from .socket_directory import prepare_socket_directory

log = logging.getLogger(__name__)

SERVICE, METHOD = WATCH_METHOD.strip("/").split("/")


class StateServer:
    """Serves `publisher` on `listen` (in the agent's event loop)."""

    def __init__(self, publisher: Publisher, listen: Listen) -> None:
        self.publisher = publisher
        self.listen = listen
        self._changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: aio.Server | None = None
        self.clients = 0

    # -- from the sync (any thread) ------------------------------------------------------------
    def notify(self) -> None:
        """A new revision was published: wake the waiting watches (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # -- the RPC -------------------------------------------------------------------------------
    async def _watch(
        self, requests: AsyncIterator[bytes], context: aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        self.clients += 1
        try:
            async for raw in requests:
                try:
                    request = pb.WatchRequest.FromString(raw)
                except DecodeError as exc:
                    log.warning(
                        "state API: a client sent a malformed WatchRequest (%s): "
                        "answered INVALID_ARGUMENT",
                        exc,
                    )
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"malformed WatchRequest: {exc}"
                    )
                while not self.publisher.ready(request.instance_id, request.revision):
                    await self._changed.wait()
                yield self.publisher.answer(
                    request.instance_id, request.revision, request.want_deltas
                )
        finally:
            self.clients -= 1

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                METHOD: grpc.stream_stream_rpc_method_handler(
                    self._watch,
                    request_deserializer=None,  # bytes: decoded in _watch (INVALID_ARGUMENT)
                    response_serializer=bytes,  # answers are encoded once per revision
                )
            },
        )
        # Responses of any size (a full state is several MB; gRPC sends any size by default,
        # said explicitly); requests stay under gRPC's default 4 MB (they are a few bytes).
        server = aio.server(
            options=[("grpc.so_reuseport", 0), ("grpc.max_send_message_length", -1)]
        )
        server.add_generic_rpc_handlers((handler,))
        if self.listen.path is None:
            bound = server.add_insecure_port(self.listen.target)
            if not bound:
                raise OSError(f"cannot listen on {self.listen.target}")
            self.listen = Listen(host=self.listen.host, port=bound)
            await server.start()
        else:
            await self._start_unix(server, self.listen.path)
        self._server = server
        log.info("node-local state API on %s", self.listen.target)

    async def _start_unix(self, server: aio.Server, path: Path) -> None:
        prepare_socket_directory(path.parent)
        staging = path.parent / f".s{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            staging.joinpath(path.name).unlink()
        staging.mkdir(mode=0o700, exist_ok=True)
        os.chmod(staging, 0o700)
        bound = staging / path.name
        # A socket path is limited to 107 bytes: bind through a descriptor of the directory.
        dir_fd = os.open(staging, os.O_PATH | os.O_DIRECTORY)
        try:
            if not server.add_insecure_port(f"unix:/proc/self/fd/{dir_fd}/{path.name}"):
                raise OSError(f"cannot listen on {bound}")
            await server.start()
        finally:
            os.close(dir_fd)
        os.chmod(bound, 0o600)
        os.replace(bound, path)  # a stale socket of a previous agent is replaced
        staging.rmdir()

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.listen.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.listen.path.unlink()
