"""spec.external: mode external, where the user's backend container programs the dataplane
from the agent's node-local state API (the agent itself runs state-server-only)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from kpx_api.durations import Duration
from kpx_api.scheduling import ResourceRequirements
from kpx_api.validation import KpxModel, Text

_IMAGE = Text(
    max_length=512,
    min_length=1,
    pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$",
    message="must be a container image reference such as example.com/my-backend:1.0",
)
_ARG = Text(max_length=4096, message="")
_ENV_NAME = Text(
    max_length=256,
    min_length=1,
    pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
    message="must be an environment variable name (letters, digits, '-', '.', '_')",
)


class EnvVar(KpxModel):
    """One environment variable of the backend container."""

    name: Annotated[str, _ENV_NAME] = Field(description="Variable name.")
    value: Annotated[str, Text(max_length=32768, message="")] = Field(
        default="", description="Variable value."
    )


class Capabilities(KpxModel):
    """Linux capabilities to add to or drop from the container."""

    add: Annotated[list[Annotated[str, Text(max_length=64, message="")]], Field(max_length=64)] = (
        Field(default_factory=list, description="Capabilities to add, e.g. NET_ADMIN.")
    )
    drop: Annotated[list[Annotated[str, Text(max_length=64, message="")]], Field(max_length=64)] = (
        Field(default_factory=list, description="Capabilities to drop, e.g. ALL.")
    )


class SecurityContext(KpxModel):
    """The backend container's securityContext (the Kubernetes fields a backend needs)."""

    privileged: bool | None = Field(default=None, strict=True, description="Run privileged.")
    run_as_user: int | None = Field(
        default=None,
        ge=0,
        strict=True,
        description="UID of the container. The state socket is 0600 and owned by the agent "
        "(root): a backend running as another user cannot connect.",
    )
    run_as_group: int | None = Field(default=None, ge=0, strict=True, description="GID.")
    run_as_non_root: bool | None = Field(
        default=None, strict=True, description="Refuse to start as root."
    )
    read_only_root_filesystem: bool | None = Field(
        default=None, strict=True, description="Mount the root filesystem read-only."
    )
    allow_privilege_escalation: bool | None = Field(
        default=None, strict=True, description="Allow gaining privileges (setuid)."
    )
    capabilities: Capabilities | None = Field(
        default=None, description="Capabilities to add and drop."
    )


class ExternalSettings(KpxModel):
    """Settings of mode external: the user's backend container, run next to the agent in
    each agent pod, sharing the directory of the state socket (/run/proxy-agent)."""

    # __rules__: modes.SYNC_PERIOD_RULES (set there: modes imports this module)

    image: Annotated[str, _IMAGE] = Field(description="Container image of the backend.")
    command: Annotated[list[Annotated[str, _ARG]], Field(max_length=64)] = Field(
        default_factory=list, description="Entrypoint (empty: the image's)."
    )
    args: Annotated[list[Annotated[str, _ARG]], Field(max_length=256)] = Field(
        default_factory=list, description="Arguments (empty: the image's)."
    )
    env: Annotated[list[EnvVar], Field(max_length=128)] = Field(
        default_factory=list,
        description="Environment variables. KPX_STATE_API is always set to the state API's "
        "address (unix:/run/proxy-agent/state.sock by default), NODE_NAME to the node's name.",
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Compute resources (requests and limits) of the backend container.",
    )
    security_context: SecurityContext = Field(
        default_factory=SecurityContext, description="securityContext of the backend container."
    )
    sync_period: Duration = Field(
        default="30s",
        description="Longest time between two recomputations of the node-local state.",
    )
    min_sync_period: Duration = Field(
        default="1s",
        description="Shortest time between two new states: changes arriving faster are "
        "batched into one revision of the state API.",
    )
