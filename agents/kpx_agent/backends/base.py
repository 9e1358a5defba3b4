"""The contract every backend implements (nftables, iptables, ipvs, external plugins)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..localnet import NodeLocalState, ProxySettings, ServicePortKey


@dataclass(frozen=True)
class NodePaths:
    """Where a backend finds node files it writes, when not at their usual place (a pod's own
    /proc/sys is read-only: the operator mounts the node's file elsewhere). None: the usual
    path of the agent's own network namespace."""

    route_localnet: Path | None = None


class BackendError(RuntimeError):
    """Programming the kernel failed; the last good rules are still in place."""


class Backend(Protocol):
    mode: str
    settings: ProxySettings  # replaced on a live configuration change (then a full sync)

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        """Make the kernel match `state`.

        `changed` lists the service ports that may differ from the last successful sync; None
        asks for a full sync (first sync, after a failure, after node or settings changes).
        Must be atomic: on error nothing of this sync is applied and BackendError is raised.
        """

    def cleanup(self) -> None:
        """Remove everything this backend ever programmed on this node."""


@runtime_checkable
class DriftCheck(Protocol):
    """A backend that can tell, cheaply, that the kernel no longer holds what it programmed (a
    deleted element, a flushed chain, another process's edit): the agent asks at every
    syncPeriod and repairs by a full sync, which rewrites everything the backend owns."""

    def drifted(self) -> str:
        """Why the kernel differs from the last successful sync ("": as far as the check
        tells, it does not). Runs between syncs, possibly in a worker thread."""
        ...
