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


class CheckUnsupported(BackendError):
    """The backend cannot ask the kernel about a ruleset without applying it."""


class Backend(Protocol):
    mode: str
    settings: ProxySettings  # replaced on a live configuration change (then a full sync)

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        """Make the kernel match `state`.

        `changed` lists the service ports that may differ from the last successful sync; None
        asks for a full sync (first sync, after a failure, after node or settings changes).
        Atomic per IP family: on error BackendError is raised, and a family whose change
        failed keeps its last good rules (the other family's may be applied: one family's
        fault does not stop the other's programming).
        """

    def cleanup(self) -> None:
        """Remove everything this backend ever programmed on this node."""

    def check(self, state: NodeLocalState) -> str | None:
        """Whether the kernel would accept `state` as this backend's whole ruleset, asked in
        the kernel's check mode: nothing is applied and nothing programmed changes. None when
        it would; else the kernel's reason. The proxier asks this only after a refused sync,
        to find the Services that cause it (`fault_isolation.py`). May raise BackendError
        when the kernel cannot be asked at all. The default: this backend has no check mode
        (CheckUnsupported): then no Service is left out and the whole sync is retried."""
        raise CheckUnsupported(f"the {self.mode} backend cannot check a ruleset")


@runtime_checkable
class DriftCheck(Protocol):
    """A backend that can tell, cheaply, that the kernel no longer holds what it programmed (a
    deleted element, a flushed chain, another process's edit): the agent asks at every
    syncPeriod and repairs by a full sync, which rewrites everything the backend owns."""

    def drifted(self) -> str:
        """Why the kernel differs from the last successful sync ("": as far as the check
        tells, it does not). Runs between syncs, possibly in a worker thread."""
        ...
