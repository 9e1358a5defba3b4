"""One sync: take recorded changes, recompute the affected node-local state, program it.

Keeps the node-local state between syncs and recomputes only the Services that changed, so a
single EndpointSlice change costs the same at 10 or 10,000 Services.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kpx_api.proxysettings import NamespaceOptOut

from . import conntrack
from .backends.base import Backend, BackendError, DriftCheck
from .cluster_state import ClusterState, Key
from .conntrack import FlowFilter, stale_flows
from .localnet import NodeLocalState, Protocol, ProxySettings, ServicePort, ServicePortKey
from .metrics import AgentMetrics
from .node_local import node_facts, node_info, service_ports, uses_topology
from .optout import excluded_namespaces
from .service_problems import ProblemBook

log = logging.getLogger(__name__)


#: A full sync is forced this often (seconds), as upstream's proxies do (FullSyncPeriod,
#: an hour), plus up to FULL_SYNC_JITTER of it, so the nodes of a cluster do not all do theirs
#: at the same moment.
FULL_SYNC_PERIOD = 3600.0
FULL_SYNC_JITTER = 0.1


def full_sync_interval(rand: float) -> float:
    """Seconds to the next forced full sync, for a random number in [0, 1)."""
    return FULL_SYNC_PERIOD * (1.0 + FULL_SYNC_JITTER * rand)


@dataclass(frozen=True)
class KernelFinding:
    """Why the periodic check asks for a full sync: `kind` (GONE, DRIFT, PERIODIC: the label
    of kpx_forced_full_syncs_total) and what was found."""

    kind: str
    detail: str


GONE, DRIFT, PERIODIC = "rules_gone", "drift", "periodic"


@dataclass
class SyncOutcome:
    ok: bool
    full: bool
    changed_ports: int
    duration: float
    error: str = ""


@dataclass
class PendingSync:
    start: float
    full: bool
    changed: set[ServicePortKey]
    trigger_times: list[float]
    prepared: float  # monotonic: when the node-local state was up to date


@dataclass
class Proxier:
    state: ClusterState
    backend: Backend
    node_name: str
    optout: NamespaceOptOut
    metrics: AgentMetrics
    local: NodeLocalState = field(init=False)
    excluded: frozenset[str] = field(default=frozenset(), init=False)
    _ports_of: dict[Key, list[ServicePortKey]] = field(default_factory=dict, init=False)
    # Services that read the node's zone (topology hints, trafficDistribution).
    _topology_users: set[Key] = field(default_factory=set, init=False)
    # Why the next sync must be a full one (empty: a partial sync will do). The only record
    # of it: backends do a full sync exactly when asked to (`changed` None).
    _full_reasons: list[str] = field(default_factory=lambda: ["first sync"], init=False)
    # The settings the node facts were computed with (the backend's, replaced on reload).
    _settings: ProxySettings | None = field(default=None, init=False)
    # UDP ports changed since the last successful sync: their state before, for conntrack.
    _udp_before: dict[ServicePortKey, ServicePort | None] = field(default_factory=dict, init=False)
    delete_flows: Callable[[Iterable[FlowFilter]], int] = field(default=conntrack.delete_flows)
    # Called after each successful sync with the state and what changed (None: a full sync),
    # as the backend got them: the node-local state API publishes there (state_api).
    on_synced: Callable[[NodeLocalState, Collection[ServicePortKey] | None], None] | None = None
    # Services left out of the dataplane (in whole or in part), by the place that decided it:
    # the agent reports new ones as Warning Events on the Service (service_problems.py).
    problems: ProblemBook = field(default_factory=ProblemBook)
    # The periodic check's clock and jitter source (forced full syncs).
    clock: Callable[[], float] = field(default=time.monotonic)
    rand: Callable[[], float] = field(default=random.random)
    _full_sync_due: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.local = NodeLocalState(node=node_info(None, self.node_name))

    def request_full_sync(self, reason: str = "requested") -> None:
        self._full_reasons.append(reason)
        self.state.touch_all()

    def _refresh_facts(self) -> None:
        """Recompute the node facts the backends render (NodePort networks, local detection)
        from the settings and the node; a change is a reason for a full sync."""
        settings = self.backend.settings
        if settings != self._settings:
            if self._settings is not None:
                self._full_reasons.append("settings changed")
            self._settings = settings
        facts = node_facts(settings, self.local.node)
        if facts != self.local.facts:
            if self.local.facts:
                self._full_reasons.append("node facts changed")
            self.local.facts = facts

    def update_excluded(self) -> bool:
        """Recompute opted-out namespaces; True (and everything marked) when the set changed."""
        excluded = excluded_namespaces(self.optout, self.state.namespaces)
        if excluded == self.excluded:
            return False
        self.excluded = excluded
        self.metrics.excluded_namespaces.set(len(excluded))
        self.state.touch_all()
        return True

    def _node_changed(self) -> set[Key]:
        """This node's object changed: the Services to recompute for it. Addresses and pod
        CIDRs reach the backends through the node facts (`_refresh_facts`: a full sync when
        what they render changed); the zone only matters to the Services that use topology;
        anything else (status heartbeats, conditions, images, other labels) costs nothing."""
        node = node_info(self.state.node, self.node_name)
        old, self.local.node = self.local.node, node
        if node.zone != old.zone:
            return set(self._topology_users)
        return set()

    def _recompute(self, services: set[Key] | None) -> set[ServicePortKey]:
        """Refresh the node-local state for these Services (None: all); the ports that changed."""
        st, local = self.state, self.local
        node = local.node
        keys = set(st.services) | set(self._ports_of) if services is None else services
        changed: set[ServicePortKey] = set()
        for svc in keys:
            old = self._ports_of.pop(svc, [])
            obj = st.services.get(svc)
            ports = []
            if obj is not None and uses_topology(obj):
                self._topology_users.add(svc)
            else:
                self._topology_users.discard(svc)
            if obj is not None and svc[0] not in self.excluded:
                ports = service_ports(obj, st.slices_of(svc), node)
            new_keys = [p.key for p in ports]
            for key in old:
                if key not in new_keys:
                    self._remember_udp(key)
                    local.services.pop(key, None)
                    changed.add(key)
            for port in ports:
                if local.services.get(port.key) != port:
                    self._remember_udp(port.key)
                    local.services[port.key] = port
                    changed.add(port.key)
            if new_keys:
                self._ports_of[svc] = new_keys
        return changed

    def _remember_udp(self, key: ServicePortKey) -> None:
        if key.protocol is Protocol.UDP and key not in self._udp_before:
            self._udp_before[key] = self.local.services.get(key)

    def _clean_conntrack(self) -> None:
        flows = [
            f
            for key, before in self._udp_before.items()
            for f in stale_flows(before, self.local.services.get(key))
        ]
        self._udp_before.clear()
        if flows:
            self.delete_flows(flows)

    def prepare(self) -> PendingSync:
        """Take the recorded changes and bring the node-local state up to date (event loop)."""
        start = time.monotonic()
        changes = self.state.take_changes()
        self.update_excluded()
        extra = self.state.take_changes()  # opt-out changes mark everything
        everything = changes.everything or extra.everything or bool(self._full_reasons)
        services = changes.services | extra.services
        if changes.node or extra.node:
            # After `everything` is decided: a new node address needs a full kernel sync,
            # not a recompute (no ServicePort depends on the node's addresses).
            services |= self._node_changed()
        self._refresh_facts()
        changed = self._recompute(None if everything else services)
        full = bool(self._full_reasons)
        if full:
            log.debug("full sync: %s", ", ".join(dict.fromkeys(self._full_reasons)))
        self._full_reasons = []
        self.metrics.service_changes.inc(len(changed))
        return PendingSync(
            start, full, changed, list(changes.trigger_times.values()), time.monotonic()
        )

    def program(self, pending: PendingSync) -> SyncOutcome:
        """Program the kernel (may run in a worker thread: nothing here touches the cluster
        state, and the next `prepare` waits for this to finish)."""
        full, changed = pending.full, pending.changed
        if not full and not changed:
            # Nothing to program (a Node heartbeat, a Service update no rule depends on): no
            # kernel work, and not counted as a sync.
            return SyncOutcome(True, False, 0, time.monotonic() - pending.start)
        try:
            self.backend.sync(self.local, None if full else changed)
        except BackendError as exc:
            self._full_reasons.append("the last sync failed")
            self.metrics.sync_failures.inc()
            self.metrics.kpx_sync_failures.labels(self.backend.mode).inc()
            log.error("sync failed, keeping the previous rules and retrying: %s", exc)
            # Changes are not lost: the next sync is a full one.
            return SyncOutcome(
                False, full, len(changed), time.monotonic() - pending.start, str(exc)
            )
        if self.on_synced is not None:
            self.on_synced(self.local, None if full else changed)
        self._clean_conntrack()
        if full:
            log.info(
                "full sync of %d service ports: %.3f s (model %.3f s, kernel %.3f s)",
                len(self.local.services),
                time.monotonic() - pending.start,
                pending.prepared - pending.start,
                time.monotonic() - pending.prepared,
            )
        now = time.time()
        duration = time.monotonic() - pending.start
        self.metrics.sync_duration.observe(duration)
        (self.metrics.full_sync_duration if full else self.metrics.partial_sync_duration).observe(
            duration
        )
        self.metrics.last_sync.set(now)
        self.metrics.services.set(len(self.local.services))
        for trigger in pending.trigger_times:
            self.metrics.network_programming.observe(max(0.0, now - trigger))
        return SyncOutcome(True, full, len(changed), duration)

    def sync(self) -> SyncOutcome:
        return self.program(self.prepare())

    def check_kernel(self) -> list[KernelFinding]:
        """At each syncPeriod: why the next sync must be a full one, which rewrites everything
        the backend owns ([]: it need not): our rules are gone from the kernel (a flushed
        ruleset), the backend's drift check found them changed behind our back (a deleted
        element, a flushed chain, another process's edit), or a forced full sync is due (every
        FULL_SYNC_PERIOD, jittered, as upstream's hourly one). Touches the backend only, not
        the cluster state: may run in a worker thread, between syncs."""
        programmed = getattr(self.backend, "programmed", None)
        if programmed is not None and not programmed():
            return [KernelFinding(GONE, "our rules are gone from the kernel")]
        found = []
        if isinstance(self.backend, DriftCheck):
            why = self.backend.drifted()
            if why:
                found.append(KernelFinding(DRIFT, why))
        now = self.clock()
        if self._full_sync_due is None:
            self._full_sync_due = now + full_sync_interval(self.rand())
        elif now >= self._full_sync_due:
            self._full_sync_due = now + full_sync_interval(self.rand())
            found.append(KernelFinding(PERIODIC, "periodic full sync"))
        return found

    def repair(self, found: Iterable[KernelFinding]) -> None:
        """Ask for the full syncs `check_kernel` found needed (the event loop)."""
        for finding in found:
            if finding.kind == PERIODIC:
                log.info("periodic full sync")
            else:
                log.warning("%s; rewriting everything we own", finding.detail)
            self.metrics.forced_full_syncs.labels(finding.kind).inc()
            self.request_full_sync(f"{finding.kind}: {finding.detail}")
