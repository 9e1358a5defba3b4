"""spec.stateAPI: the agent's node-local state API (gRPC, kpx.localstate.v1) for out-of-tree
backends."""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field

from kpx_api.validation import KpxModel, Text

DEFAULT_STATE_ADDRESS: Final = "unix:///run/proxy-agent/state.sock"

#: A unix socket path, or TCP on a loopback address only (the API has no authentication: on a
#: unix socket the file's mode restricts it to the agent's user).
STATE_ADDRESS_PATTERN: Final = (
    r"^(unix:///[^\x00]*[^/\x00]|tcp://(127(\.[0-9]{1,3}){3}|\[::1\]):[0-9]{1,5})$"
)

StateAddress = Annotated[
    str,
    Text(
        max_length=256,
        min_length=1,
        pattern=STATE_ADDRESS_PATTERN,
        message="must be unix:///absolute/path or tcp://127.0.0.1:PORT (loopback only)",
    ),
]


class StateAPI(KpxModel):
    """Where the agent serves its node-local state to out-of-tree backends."""

    enabled: bool = Field(
        default=False,
        strict=True,
        description="Serve the node-local state API. Always on in mode external (the "
        "external backend reads it); off by default in the other modes.",
    )
    address: StateAddress = Field(
        default=DEFAULT_STATE_ADDRESS,
        description="unix:///path (the socket is 0600, owned by the agent: only its user can "
        "connect; a missing directory is created 0750, an existing one is left as it is, a "
        "shared one such as /tmp is refused), or tcp://127.0.0.1:PORT / tcp://[::1]:PORT "
        "(loopback only; any local process can connect). The agent's --state-socket flag "
        "overrides it.",
    )
