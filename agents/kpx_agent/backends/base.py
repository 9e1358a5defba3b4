"""The contract every mode implements: its package (`Mode`, what the registry's `load` returns)
and the backend it creates (`Backend`: every capability the agent's core uses, with defaults)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..model.types import DataplaneSettings, NodeLocalState, ServicePortKey


@dataclass(frozen=True)
class NodePaths:
    """Where a backend finds node files it writes, when not at their usual place (a pod's own
    /proc/sys is read-only: the operator mounts the node's file elsewhere). None: the usual
    path of the agent's own network namespace."""

    route_localnet: Path | None = None
    #: The node's net/ipv4 sysctl directory (mode ipvs: vs/conntrack and the other IPVS
    #: settings, conf/all/arp_* under strictARP).
    ipv4_sysctls: Path | None = None


class BackendError(RuntimeError):
    """Programming the kernel failed; the last good rules are still in place."""


class CheckUnsupported(BackendError):
    """The backend cannot ask the kernel about a ruleset without applying it."""


class Draining(Exception):
    """Raised by a removal of leftovers that did what it could and waits for connections
    through the rest to end (kpx's IPVS virtual servers): not a failure; tried again every
    `drain_poll` s (takeover.py). The old rules no longer take new connections then, so it
    does not hold readiness."""


@dataclass(frozen=True)
class Handover:
    """What an agent of another mode hands a mode whose leftovers it removes (`Mode.remove_
    leftovers`), after its own first verified sync: its settings (ipvs: its excludeCIDRs
    stay), and whether upstream kube-proxy's ipvs mode has its chains on this node (then the
    node's IPVS state is kube-proxy's, removed only by the takeover path)."""

    settings: DataplaneSettings
    kube_proxy_ipvs_mode_here: Callable[[], bool]


class KernelReadBack:
    """What a backend's drift check read from the kernel (`Backend.read_kernel`); each
    backend that reads ahead has its own kind, which only it looks into."""


class Backend(Protocol):
    """A mode's dataplane. `sync`, `cleanup` and `reconfigure` are each backend's own; the
    other methods have defaults for a backend that cannot tell (the core calls every one)."""

    mode: str

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

    def reconfigure(self, settings: DataplaneSettings) -> None:
        """Program with `settings` from the next sync on (a live configuration change; the
        proxier asks for a full sync with it)."""

    def check(self, state: NodeLocalState) -> str | None:
        """Whether the kernel would accept `state` as this backend's whole ruleset, asked in
        the kernel's check mode: nothing is applied and nothing programmed changes. None when
        it would; else the kernel's reason. The proxier asks this only after a refused sync,
        to find the Services that cause it (`fault_isolation.py`). May raise BackendError
        when the kernel cannot be asked at all. The default: this backend has no check mode
        (CheckUnsupported): then no Service is left out and the whole sync is retried."""
        raise CheckUnsupported(f"the {self.mode} backend cannot check a ruleset")

    def programmed(self) -> bool:
        """Whether the kernel holds this backend's rules (someone may flush them): asked after
        the first full sync (make-before-break waits for it, takeover.py) and at every
        syncPeriod (False: a full sync). The default: a successful sync is the proof."""
        return True

    def read_kernel(self) -> KernelReadBack | None:
        """The slow half of the drift check: what `drifted` compares, read from the kernel.
        Runs in a worker thread *while syncs go on* (a read-back takes seconds at scale, and
        no change waits for it), so it changes nothing a sync uses; `drifted` judges whether
        what it read still stands after the syncs that ran meanwhile (iptables leaves out the
        chains they rewrote, nftables uses digests only of the generation still in place).
        The default: nothing (`drifted` reads what it needs itself)."""
        return None

    def drifted(self, reading: KernelReadBack | None = None) -> str:
        """Why the kernel differs from the last successful sync (a deleted element, a flushed
        chain, another process's edit; "": as far as the check tells, it does not): asked at
        every syncPeriod with what `read_kernel` read (None: read now), repaired by a full
        sync. Runs between syncs, possibly in a worker thread. The default: no drift check."""
        return ""

    def element_count(self) -> int:
        """Set and map elements (iptables: rules) programmed (kpx_programmed_elements and the
        ProxyNodeState's rules). The default: 0, not counted."""
        return 0

    def rule_counts(self) -> Mapping[tuple[int, str], tuple[int, int]]:
        """Per (IP family, table): the rules in our chains and the rules the last sync wrote
        (upstream's iptables rule metrics). The default: none."""
        return {}

    def packet_counts(self) -> Mapping[str, float]:
        """Upstream's nfacct packet counters by metric name, from rule counters; read at each
        scrape, in a worker thread. The default: none (the counters stay 0)."""
        return {}


@runtime_checkable
class Mode(Protocol):
    """What a mode's package provides (each of backends.REGISTRY's modules, as the registry's
    `load` returns it)."""

    def create(self, settings: DataplaneSettings, paths: NodePaths | None = None) -> Backend:
        """A backend of this mode; `paths`: where node files it writes are mounted."""
        ...

    def cleanup(self) -> None:
        """Remove everything this mode ever programmed on this node (`proxy-agent cleanup`)."""
        ...

    def remove_leftovers(self, handover: Handover) -> None:
        """Remove what an agent of this mode left on this node, for an agent of another mode
        (after its first verified sync): only what a kpx agent made. May raise Draining."""
        ...
