"""Client of the kpx agent's node-local state API (kpx.localstate.v1).

    from kpx_localstate_client import run, State

    def handler(state: State) -> None:
        for port in state.service_ports.values():
            ...

    run(handler)  # until SIGTERM/SIGINT

Depends on grpcio and protobuf only. See README.md.
"""

from __future__ import annotations

from . import localstate_pb2
from .client import (
    CHANNEL_OPTIONS,
    DEFAULT_TARGET,
    TARGET_ENV,
    WATCH_METHOD,
    PortKey,
    State,
    StateClient,
    default_target,
    run,
)

__all__ = [
    "CHANNEL_OPTIONS",
    "DEFAULT_TARGET",
    "TARGET_ENV",
    "WATCH_METHOD",
    "PortKey",
    "State",
    "StateClient",
    "default_target",
    "localstate_pb2",
    "run",
]
