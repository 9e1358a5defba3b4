"""`run(handler)`: hand the handler the agent's full node-local state after each change.

Blocking and thread-based (no asyncio needed in the plugin). Reconnects with exponential
backoff while the agent is away; after an agent restart (a new instance id) the next state is a
full one; SIGTERM and SIGINT stop it cleanly (the handler is never interrupted mid-call).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from . import localstate_pb2 as pb

log = logging.getLogger("kpx_localstate_client")

DEFAULT_TARGET = "unix:///run/proxy-agent/state.sock"
#: In mode external the operator sets it in the backend container to the agent's address.
TARGET_ENV = "KPX_STATE_API"


def default_target() -> str:
    """$KPX_STATE_API, else DEFAULT_TARGET."""
    return os.environ.get(TARGET_ENV) or DEFAULT_TARGET


#: The one RPC of the API, as gRPC names it.
WATCH_METHOD = "/kpx.localstate.v1.LocalState/Watch"

#: A full state outgrows gRPC's default 4 MB limit on received messages (10,000 Service ports
#: x 10 endpoints: about 5 MB): the client takes messages of any size.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", -1),)


class PortKey(NamedTuple):
    """A Service port's identity (ServicePortKey as a hashable tuple)."""

    namespace: str
    name: str
    port_name: str
    protocol: int  # localstate_pb2.TCP, UDP or SCTP
    family: int  # 4 or 6

    @classmethod
    def of(cls, key: pb.ServicePortKey) -> PortKey:
        return cls(key.namespace, key.name, key.port_name, key.protocol, key.family)


@dataclass
class State:
    """The agent's node-local state at one revision."""

    instance_id: str = ""
    revision: int = 0
    node: pb.NodeInfo = field(default_factory=pb.NodeInfo)
    settings: pb.ProxySettings = field(default_factory=pb.ProxySettings)
    #: What the agent decided about its node, by IP family (4, 6): where NodePorts answer,
    #: how local pods are recognised, NodePorts on localhost.
    node_facts: dict[int, pb.NodeFacts] = field(default_factory=dict)
    service_ports: dict[PortKey, pb.ServicePort] = field(default_factory=dict)
    #: What the last response changed: None after a full state (anything may have changed),
    #: else the keys set and the keys deleted (for handlers that work incrementally).
    changed: frozenset[PortKey] | None = None
    deleted: frozenset[PortKey] = frozenset()

    def apply(self, response: pb.WatchResponse) -> None:
        """Apply one WatchResponse (a full state, or the delta from the revision held)."""
        sets = {PortKey.of(p.key): p for p in response.service_ports}
        if response.full:
            self.service_ports = sets
            self.changed, self.deleted = None, frozenset()
        else:
            if (response.instance_id, response.revision - 1) != (self.instance_id, self.revision):
                raise ValueError(
                    f"delta to revision {response.revision} of {response.instance_id}, but "
                    f"revision {self.revision} of {self.instance_id or '-'} is held"
                )
            deleted = frozenset(PortKey.of(k) for k in response.deleted)
            ports = dict(self.service_ports)
            for key in deleted:
                ports.pop(key, None)
            ports.update(sets)
            self.service_ports = ports
            self.changed, self.deleted = frozenset(sets), deleted
        self.instance_id, self.revision = response.instance_id, response.revision
        self.node, self.settings = response.node, response.settings
        self.node_facts = {f.family: f for f in response.node_facts}


def _short_target(target: str) -> tuple[str, int | None]:
    """A unix socket path longer than a socket address holds (107 bytes) is reached through
    a descriptor of its directory (/proc/self/fd/N/name); the descriptor is to be closed."""
    for prefix in ("unix://", "unix:"):
        if target.startswith(prefix):
            path = target[len(prefix) :]
            if len(path.encode()) <= 107:
                return target, None
            directory, _, name = path.rpartition("/")
            dir_fd = os.open(directory or "/", os.O_PATH | os.O_DIRECTORY)
            return f"unix:/proc/self/fd/{dir_fd}/{name}", dir_fd
    return target, None


class StateClient:
    """One connection to the agent (reused across reconnects); `states()` yields each state."""

    def __init__(self, target: str | None = None, want_deltas: bool = True) -> None:
        self.target = target or default_target()
        self.want_deltas = want_deltas
        self.state = State()
        self._call: Any = None
        self._requests: queue.SimpleQueue[pb.WatchRequest | None] = queue.SimpleQueue()
        self._closed = threading.Event()

    def _request(self) -> pb.WatchRequest:
        return pb.WatchRequest(
            instance_id=self.state.instance_id,
            revision=self.state.revision,
            want_deltas=self.want_deltas,
        )

    def _outgoing(self, requests: queue.SimpleQueue[pb.WatchRequest | None]) -> Iterator[Any]:
        while (request := requests.get()) is not None:
            yield request

    def states(self) -> Iterator[State]:
        """Connect, and yield the state after each response until the stream ends (raises
        grpc.RpcError when the agent is unreachable or goes away). Resumes from the state
        held: the agent answers only when it has something newer."""
        target, dir_fd = _short_target(self.target)
        try:
            yield from self._states(target)
        finally:
            if dir_fd is not None:
                os.close(dir_fd)

    def _states(self, target: str) -> Iterator[State]:
        with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
            watch = channel.stream_stream(
                WATCH_METHOD,
                request_serializer=pb.WatchRequest.SerializeToString,
                response_deserializer=pb.WatchResponse.FromString,
            )
            requests: queue.SimpleQueue[pb.WatchRequest | None] = queue.SimpleQueue()
            self._requests = requests
            requests.put(self._request())
            self._call = watch(self._outgoing(requests), wait_for_ready=False)
            try:
                for response in self._call:
                    self.state.apply(response)
                    yield self.state
                    requests.put(self._request())  # ready for the next state
            finally:
                requests.put(None)
                self._call.cancel()
                self._call = None

    def close(self) -> None:
        """Stop `states()` from another thread (or a signal handler)."""
        self._closed.set()
        call = self._call
        if call is not None:
            call.cancel()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


def run(
    handler: Callable[[State], None],
    target: str | None = None,
    *,
    want_deltas: bool = True,
    min_backoff: float = 0.1,
    max_backoff: float = 10.0,
    handle_signals: bool = True,
    client: StateClient | None = None,
) -> None:
    """Call `handler(state)` with the full state after each change, until SIGTERM or SIGINT
    (or `client.close()`); `target` defaults to $KPX_STATE_API, else DEFAULT_TARGET.
    Reconnects with exponential backoff (min_backoff doubling up to
    max_backoff, reset after a successful response). An exception of the handler ends `run`."""
    client = client or StateClient(target, want_deltas)
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: client.close())
    backoff = min_backoff
    while not client.closed:
        try:
            for state in client.states():
                backoff = min_backoff
                handler(state)
                if client.closed:
                    break
        except grpc.RpcError as exc:
            if client.closed:
                break
            code = exc.code() if isinstance(exc, grpc.Call) else None
            log.warning("state API %s: %s; retrying in %.1f s", client.target, code, backoff)
        else:
            if client.closed:
                break
        client._closed.wait(backoff)
        backoff = min(backoff * 2, max_backoff)
    log.info("stopped at revision %d", client.state.revision)
