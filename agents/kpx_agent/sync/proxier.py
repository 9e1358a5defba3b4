"""One sync: take recorded changes, recompute the affected node-local state, program it.

Keeps the node-local state between syncs and recomputes only the Services that changed, so a
single EndpointSlice change costs the same at 10 or 10,000 Services.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kpx_api.proxysettings import NamespaceOptOut

from ..backends.base import Backend, BackendError, CheckUnsupported, KernelReadBack
from ..conntrack import stale_flows as conntrack
from ..conntrack.cleaner import ConntrackCleaner
from ..conntrack.stale_flows import (
    FlowFilter,
    reconcile_flows,
    stale_flows,
    udp_addresses_by_port,
)
from ..model.external_ips import APISERVER_SERVICE, ExternalIPPolicy, apiserver_addresses
from ..model.quarantine import MAX_SERVICE_COST, cost, quarantine
from ..model.service_ports import (
    node_facts,
    node_info,
    service_model,
    serving_addresses,
    uses_topology,
)
from ..model.service_problems import REFUSED_BY_KERNEL, ProblemBook, ServiceProblem
from ..model.types import (
    DataplaneSettings,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)
from ..model.vip_claims import VipClaims, creation_time
from ..observability.metrics import FAMILY_LABELS, AgentMetrics, failed_families
from ..store.cluster_state import ClusterState, Key
from ..store.optout import excluded_namespaces
from .budget import MAX_SYNC_COST, split_by_budget
from .fault_isolation import find_culprits

log = logging.getLogger(__name__)
#: The problem source of the Services the kernel refused (`problems`).
DATAPLANE = "dataplane"
Part = tuple[str, str, int]  # (namespace, name, IP family): one Service in one family


def part_of(key: ServicePortKey) -> Part:
    return (key.namespace, key.name, key.family)


#: The problem book's source for what the node-local model leaves out.
MODEL_PROBLEMS = "model"


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


@dataclass(frozen=True)
class KernelReading:
    """What the periodic check read from the kernel (`Proxier.read_kernel`, while syncs go
    on), for `Proxier.check_kernel` to judge between syncs."""

    programmed: bool  # the backend's rules were there (`Backend.programmed`)
    syncs: int  # `Proxier.sync_edges` before the read (odd: a sync was running)
    backend: KernelReadBack | None  # the backend's own (`Backend.read_kernel`)


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
    trigger_times: dict[Key, float]  # the Services' EndpointSlices' trigger times
    prepared: float  # monotonic: when the node-local state was up to date
    #: a full sync that rewrites rules found gone or changed behind our back
    repair: bool = False


@dataclass
class Proxier:
    state: ClusterState
    backend: Backend
    node_name: str
    optout: NamespaceOptOut
    metrics: AgentMetrics
    # The settings the node-local model and the backend program with (the agent's, replaced
    # by `reconfigure` on a live change and by a rollback).
    settings: DataplaneSettings
    local: NodeLocalState = field(init=False)
    excluded: frozenset[str] = field(default=frozenset(), init=False)
    _ports_of: dict[Key, list[ServicePortKey]] = field(default_factory=dict, init=False)
    # Services that read the node's zone (topology hints, trafficDistribution).
    _topology_users: set[Key] = field(default_factory=set, init=False)
    # Services with spec.externalIPs (recomputed when the externalIPs policy changes), and
    # the policy they were computed with (external_ips.py).
    _external_ip_users: set[Key] = field(default_factory=set, init=False)
    _external_ips: ExternalIPPolicy = field(default_factory=ExternalIPPolicy, init=False)
    # Why the next sync must be a full one (empty: a partial sync will do). The only record
    # of it: backends do a full sync exactly when asked to (`changed` None).
    _full_reasons: list[str] = field(default_factory=lambda: ["first sync"], init=False)
    # The settings the node facts were computed with.
    _settings: DataplaneSettings | None = field(default=None, init=False)
    # Ports changed and not yet programmed: each one as the kernel holds it (None: absent).
    # A deferred port is programmed as this until its turn (budget.py); the UDP ones are also
    # what conntrack cleans after (stale flows of endpoints that went away).
    _before: dict[ServicePortKey, ServicePort | None] = field(default_factory=dict, init=False)
    # Ports changed but left to the next syncs by the budget of one partial sync (budget.py),
    # and the trigger times of their Services (observed once the last of their ports is in).
    _deferred: set[ServicePortKey] = field(default_factory=set, init=False)
    _deferred_triggers: dict[Key, float] = field(default_factory=dict, init=False)
    # Endpoints one partial sync programs at most (budget.py).
    max_sync_cost: int = MAX_SYNC_COST
    # Runs the stale-flow deletions (in the conntrack cleaner's thread: off the programming
    # path); returns how many failed.
    delete_flows: Callable[[Iterable[FlowFilter]], int] = field(default=conntrack.delete_flows)
    conntrack_cleaner: ConntrackCleaner = field(init=False)
    # Backend syncs begun plus those ended (odd while one runs): a kernel reading the periodic
    # check took while syncs went on knows from it whether one overlapped (`read_kernel`).
    sync_edges: int = field(default=0, init=False)
    # Called after each successful sync with the state and what changed (None: a full sync),
    # as the backend got them: the node-local state API publishes there (state_api).
    on_synced: Callable[[NodeLocalState, Collection[ServicePortKey] | None], None] | None = None
    # Services left out of the dataplane (in whole or in part), by the place that decided it:
    # the agent reports new ones as Warning Events on the Service (service_problems.py).
    problems: ProblemBook = field(default_factory=ProblemBook)
    # What one Service may cost in one IP family before it is quarantined (quarantine.py).
    max_service_cost: int = MAX_SERVICE_COST
    # Services (in one IP family: the other is programmed) left out of the dataplane because
    # the kernel refused their rules, with the kernel's reason: tried again when they change,
    # and at every full sync.
    _refused: dict[Part, str] = field(default_factory=dict, init=False)
    # The model's ports before the VIP claims decide (`local.services` holds them after).
    _raw: dict[ServicePortKey, ServicePort] = field(default_factory=dict, init=False)
    _claims: VipClaims = field(default_factory=VipClaims, init=False)
    # The model's problems (source MODEL_PROBLEMS in the book): VIP clashes of each port, and
    # what the model left out of each Service (service_model).
    _clashes: dict[ServicePortKey, tuple[ServiceProblem, ...]] = field(
        default_factory=dict, init=False
    )
    _service_problems: dict[Key, tuple[ServiceProblem, ...]] = field(
        default_factory=dict, init=False
    )
    _problems_changed: bool = field(default=False, init=False)
    # The periodic check's clock and jitter source (forced full syncs).
    clock: Callable[[], float] = field(default=time.monotonic)
    rand: Callable[[], float] = field(default=random.random)
    _full_sync_due: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.local = NodeLocalState(node=node_info(None, self.node_name))
        # `delete_flows` looked up at each batch: tests replace it after construction.
        self.conntrack_cleaner = ConntrackCleaner(
            lambda flows: self.delete_flows(flows), self._conntrack_reconciled
        )

    def _conntrack_reconciled(self, families: list[int], duration: float, failures: int) -> None:
        self.metrics.conntrack_reconciled(families, duration, conntrack.deleted_by_family, failures)

    def request_full_sync(self, reason: str = "requested") -> None:
        self._full_reasons.append(reason)
        self.state.touch_all()

    def reconfigure(self, settings: DataplaneSettings) -> None:
        """A live configuration change: the model and the backend use `settings` from the next
        sync on, a full one."""
        self.settings = settings
        self.backend.reconfigure(settings)
        self.request_full_sync()

    def _refresh_facts(self) -> None:
        """Recompute the node facts the backends render (NodePort networks, local detection)
        from the settings and the node; a change is a reason for a full sync."""
        settings = self.settings
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

    def _refresh_external_ips(self) -> set[Key]:
        """Recompute the externalIPs policy (settings, this node's addresses, the apiserver's
        endpoints); when it changed, the Services with externalIPs to recompute."""
        policy = ExternalIPPolicy(
            allowed=self.settings.external_ip_networks,
            node_addresses=frozenset(self.local.node.addresses),
            apiserver_addresses=apiserver_addresses(self.state.slices_of(APISERVER_SERVICE)),
        )
        if policy == self._external_ips:
            return set()
        self._external_ips = policy
        return set(self._external_ip_users)

    def _recompute(self, services: set[Key] | None) -> set[ServicePortKey]:
        """Refresh the node-local state for these Services (None: all); the ports that changed.

        The model's ports (`_raw`) go through the VIP claims (vip_claims.py) before they are
        programmed: a port whose VIP another port won is programmed without it, and every
        claimant of a VIP whose winner may have changed is resolved again."""
        st = self.state
        node = self.local.node
        keys = set(st.services) | set(self._ports_of) if services is None else services
        claims, raw = self._claims, self._raw
        dependants: set[ServicePortKey] = set()
        for svc in keys:
            old = self._ports_of.pop(svc, [])
            obj = st.services.get(svc)
            ports: list[ServicePort] = []
            created = 0.0
            if obj is not None and uses_topology(obj):
                self._topology_users.add(svc)
            else:
                self._topology_users.discard(svc)
            problems: tuple[ServiceProblem, ...] = ()
            if obj is not None and (obj.get("spec") or {}).get("externalIPs"):
                self._external_ip_users.add(svc)
            else:
                self._external_ip_users.discard(svc)
            if obj is not None and svc[0] not in self.excluded:
                ports, problems = service_model(obj, st.slices_of(svc), node, self._external_ips)
                ports, too_big = quarantine(svc[0], svc[1], ports, self.max_service_cost)
                problems += too_big
                created = creation_time((obj.get("metadata") or {}).get("creationTimestamp"))
            new_keys = [p.key for p in ports]
            for key in old:
                if key not in new_keys:
                    raw.pop(key, None)
                    dependants |= claims.update(key, None)
            for port in ports:
                if raw.get(port.key) != port:
                    raw[port.key] = port
                    dependants |= claims.update(port.key, port, created)
            if new_keys:
                self._ports_of[svc] = new_keys
            if problems:
                self._problems_changed |= self._service_problems.get(svc) != problems
                self._service_problems[svc] = problems
            elif self._service_problems.pop(svc, None) is not None:
                self._problems_changed = True
        changed = self._resolve(dependants)
        if self._problems_changed:
            self._problems_changed = False
            self.problems.replace(
                MODEL_PROBLEMS,
                (
                    p
                    for book in (self._clashes, self._service_problems)
                    for found in book.values()
                    for p in found
                ),
            )
        return changed

    def _resolve(self, keys: set[ServicePortKey]) -> set[ServicePortKey]:
        """Program these ports as their claims decide; the ports that changed."""
        local, changed = self.local, set()
        for key in keys:
            port = self._raw.get(key)
            problems: tuple[ServiceProblem, ...] = ()
            if port is None:
                if key in local.services:
                    self._remember(key)
                    del local.services[key]
                    changed.add(key)
            else:
                port, problems = self._claims.resolve(port)
                if local.services.get(key) != port:
                    self._remember(key)
                    local.services[key] = port
                    changed.add(key)
            if problems:
                self._problems_changed |= self._clashes.get(key) != problems
                self._clashes[key] = problems
            elif self._clashes.pop(key, None) is not None:
                self._problems_changed = True
        return changed

    def _remember(self, key: ServicePortKey) -> None:
        """Before a port changes: keep what the kernel holds for it, until it is programmed."""
        if key not in self._before:
            self._before[key] = self.local.services.get(key)

    def _programmed(
        self, full: bool, changed: Collection[ServicePortKey], repair: bool = False
    ) -> None:
        """After a successful sync: the ports it programmed are the kernel's now (a full sync:
        all but the deferred ones); clean the conntrack entries their changes left (after a
        repair, every port's: the kernel may have had no rule for any of them)."""
        done = [k for k in self._before if k not in self._deferred and (full or k in changed)]
        flows: dict[FlowFilter, None] = {}
        udp_addresses: dict[int, frozenset[str]] | None = None
        for key in done:
            before = self._before.pop(key)
            now = self.local.services.get(key)
            flows.update(dict.fromkeys(stale_flows(before, now)))
            if before is None and now is not None and now.protocol is Protocol.UDP:
                # first programmed (every port at the agent's start): what the kernel's
                # entries may hold from before, DNATed to endpoints gone since
                if now.node_port and udp_addresses is None:
                    udp_addresses = udp_addresses_by_port(self.local.services.values())
                slices = self.state.slices_of((key.namespace, key.name))
                serving = serving_addresses(slices, key)
                flows.update(dict.fromkeys(reconcile_flows(now, serving, udp_addresses)))
        if repair:
            for key, port in self.local.services.items():
                if key not in self._deferred:
                    flows.update(dict.fromkeys(stale_flows(None, port)))
        if flows:
            self.conntrack_cleaner.submit(flows)  # deleted after this sync, not during it

    def _bound(
        self, changed: set[ServicePortKey], triggers: dict[Key, float]
    ) -> tuple[set[ServicePortKey], dict[Key, float]]:
        """A partial sync's ports within the budget of one sync (budget.py), the others
        deferred to the next syncs; the trigger times of the Services it completes."""
        changed |= self._deferred
        triggers = {**self._deferred_triggers, **triggers}

        def port_cost(key: ServicePortKey) -> int:
            port = self.local.services.get(key) or self._before.get(key)
            return 1 + (cost(port) if port is not None else 0)

        now, self._deferred = split_by_budget(changed, port_cost, self.max_sync_cost)
        waiting = {(k.namespace, k.name) for k in self._deferred}
        self._deferred_triggers = {s: t for s, t in triggers.items() if s in waiting}
        if self._deferred:
            log.info(
                "partial sync of %d service ports; %d more (%s ...) follow at once",
                len(now),
                len(self._deferred),
                ", ".join(sorted({f"{k.namespace}/{k.name}" for k in self._deferred})[:3]),
            )
        return now, {s: t for s, t in triggers.items() if s not in waiting}

    def has_deferred(self) -> bool:
        """Ports changed but left to the next syncs by the budget of one sync."""
        return bool(self._deferred)

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
            # not a recompute (the only ServicePorts that depend on the node's addresses, those
            # with externalIPs, are recomputed by _refresh_external_ips).
            services |= self._node_changed()
        self._refresh_facts()
        services |= self._refresh_external_ips()
        changed = self._recompute(None if everything else services)
        full = bool(self._full_reasons)
        triggers = changes.trigger_times
        if full:
            self._refused.clear()  # everything is tried again
            self._deferred.clear()  # a full sync programs everything in one transaction
            triggers = {**self._deferred_triggers, **triggers}
            self._deferred_triggers = {}
        else:
            changed, triggers = self._bound(changed, triggers)
        for key in changed:
            self._refused.pop(part_of(key), None)
        if full:
            log.debug("full sync: %s", ", ".join(dict.fromkeys(self._full_reasons)))
        repair = any(r.startswith((f"{GONE}:", f"{DRIFT}:")) for r in self._full_reasons)
        self._full_reasons = []
        self.metrics.changed_ports.inc(len(changed))
        return PendingSync(start, full, changed, triggers, time.monotonic(), repair)

    def program(self, pending: PendingSync) -> SyncOutcome:
        """Program the kernel (may run in a worker thread: nothing here touches the cluster
        state, and the next `prepare` waits for this to finish)."""
        full, changed = pending.full, pending.changed
        if not full and not changed:
            # Nothing to program (a Node heartbeat, a Service update no rule depends on): no
            # kernel work, and not counted as a sync. The EndpointSlice changes it carries need
            # no rule (say, a slice that came before its Service): their programming is done,
            # and counted, as upstream counts every trigger time a sync takes.
            self._observe_programming(pending, time.time())
            return SyncOutcome(True, False, 0, time.monotonic() - pending.start)
        state = self.programmable()
        self.sync_edges += 1  # odd while the backend programs
        try:
            try:
                self.backend.sync(state, None if full else changed)
            except BackendError as exc:
                if not self._isolate(exc, full, changed):
                    raise
                # The kernel accepts the rest: program it (the backend swaps its tables
                # after a refused sync, whatever it is asked).
                state, full = self.programmable(), True
                self.backend.sync(state, None)
            finally:
                self.sync_edges += 1
        except BackendError as exc:
            self._report_refused()
            self._full_reasons.append("the last sync failed")
            # The full retry takes the ports still waiting too; nothing goes on at once (the
            # loop's backoff paces the retry).
            self._deferred.clear()
            self.metrics.sync_failed(self.backend.mode, failed_families(str(exc)), not full)
            log.error("sync failed, keeping the previous rules and retrying: %s", exc)
            # Changes are not lost: the next sync is a full one.
            return SyncOutcome(
                False, full, len(changed), time.monotonic() - pending.start, str(exc)
            )
        self._report_refused()
        if self.on_synced is not None:
            self.on_synced(state, None if full else changed)
        self._programmed(full, changed, pending.repair)
        if full:
            log.debug(
                "full sync of %d service ports: %.3f s (model %.3f s, kernel %.3f s)",
                len(self.local.services),
                time.monotonic() - pending.start,
                pending.prepared - pending.start,
                time.monotonic() - pending.prepared,
            )
        now = time.time()
        duration = time.monotonic() - pending.start
        self.metrics.synced(full, duration, now)
        self.metrics.services.set(len(self.local.services))
        self._observe_programming(pending, now)
        for (family, table), (total, last) in self.backend.rule_counts().items():
            self.metrics.iptables_rules.labels(table, FAMILY_LABELS[family]).set(total)
            self.metrics.iptables_rules_last.labels(table, FAMILY_LABELS[family]).set(last)
        return SyncOutcome(True, full, len(changed), duration)

    def _observe_programming(self, pending: PendingSync, now: float) -> None:
        """Network programming latency: for each Service whose EndpointSlices carried a
        trigger time, from it to now, in each IP family of the ports this sync changed for it
        (all of them when it changed none: its rules were already right)."""
        if not pending.trigger_times:
            return
        families: dict[Key, set[int]] = {}
        for key in pending.changed:
            families.setdefault((key.namespace, key.name), set()).add(key.family)
        for svc, trigger in pending.trigger_times.items():
            for family in sorted(families.get(svc) or FAMILY_LABELS):
                self.metrics.network_programming.labels(FAMILY_LABELS[family]).observe(
                    max(0.0, now - trigger)
                )

    def sync(self) -> SyncOutcome:
        return self.program(self.prepare())

    def programmable(self) -> NodeLocalState:
        """The node-local state without the Services the kernel refused, and with the ports
        deferred to the next syncs as the kernel holds them (so every backend renders a
        consistent state: the programmed one plus this sync's ports)."""
        if not self._refused and not self._deferred:
            return self.local
        local, refused = self.local, self._refused
        services = {k: sp for k, sp in local.services.items() if part_of(k) not in refused}
        for key in self._deferred:
            before = self._before.get(key)
            if before is None or part_of(key) in refused:
                services.pop(key, None)
            else:
                services[key] = before
        return NodeLocalState(local.node, services, local.facts)

    def _isolate(
        self, error: BackendError, full: bool, changed: Collection[ServicePortKey]
    ) -> bool:
        """After a refused sync: find the Services without which the kernel accepts the rest
        (asked in the backend's check mode, nothing programmed changes), and leave them out.
        Each IP family of a Service is searched apart (a dual-stack Service whose IPv6 rules
        are refused keeps its IPv4 ones). A partial sync searches the Services it changed,
        the others first (the kernel holds them already); a full sync searches every Service.
        False when nothing was found to leave out (the fault is elsewhere, or the backend
        cannot check)."""
        state = self.programmable()
        ports: dict[Part, list[ServicePortKey]] = {}
        for key in state.services:
            ports.setdefault(part_of(key), []).append(key)
        touched = {part_of(k) for k in changed}
        suspects = sorted(ports) if full else sorted(touched & ports.keys())
        good = [] if full else sorted(ports.keys() - touched)

        def check(included: Collection[Part]) -> str | None:
            services = {k: state.services[k] for svc in included for k in ports[svc]}
            return self.backend.check(NodeLocalState(state.node, services, state.facts))

        started = time.monotonic()
        try:
            search = find_culprits(suspects, check, good)
        except CheckUnsupported:
            return False
        except BackendError as exc:
            log.error("could not ask the kernel which Service it refuses: %s", exc)
            return False
        log.info(
            "sync refused (%s): %d checks in %.3f s found %s",
            str(error).splitlines()[0][:300] if str(error) else "no message",
            search.checks,
            time.monotonic() - started,
            ", ".join(f"{ns}/{name} (IPv{fam})" for ns, name, fam in search.culprits)
            or "no Service to leave out",
        )
        if not search.isolated or not search.culprits:
            return False
        for (ns, name, fam), reason in search.culprits.items():
            log.error(
                "Service %s/%s left out in IPv%d: the kernel refuses its rules: %s",
                ns,
                name,
                fam,
                reason,
            )
        self._refused.update(search.culprits)
        return True

    def _report_refused(self) -> None:
        self.problems.replace(
            DATAPLANE,
            (
                ServiceProblem(ns, name, REFUSED_BY_KERNEL, refused_message(family, reason))
                for (ns, name, family), reason in self._refused.items()
            ),
        )

    def read_kernel(self) -> KernelReading:
        """The periodic check's reading of the kernel (seconds at scale in iptables mode): in
        a worker thread, while syncs go on (`check_kernel` judges it between syncs)."""
        syncs = self.sync_edges
        return KernelReading(self.backend.programmed(), syncs, self.backend.read_kernel())

    def check_kernel(self, reading: KernelReading | None = None) -> list[KernelFinding]:
        """At each syncPeriod, from `reading` (`read_kernel`; None: read now): why the next
        sync must be a full one, which rewrites everything the backend owns ([]: it need
        not): our rules are gone from the kernel (a flushed ruleset), the backend's drift
        check found them changed behind our back (a deleted element, a flushed chain, another
        process's edit), or a forced full sync is due (every FULL_SYNC_PERIOD, jittered, as
        upstream's hourly one). Touches the backend only, not the cluster state: may run in a
        worker thread, between syncs."""
        if reading is None:
            reading = self.read_kernel()
        # Rules found gone while a sync ran may have been that sync's own full rewrite in
        # progress: only a reading no sync overlapped tells.
        quiet = reading.syncs == self.sync_edges and reading.syncs % 2 == 0
        if not reading.programmed and quiet:
            return [KernelFinding(GONE, "our rules are gone from the kernel")]
        found = []
        why = self.backend.drifted(reading.backend)
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


def refused_message(family: int, reason: str) -> str:
    """The problem's message: the family left out and the kernel's reason, its first line
    (nft adds the offending line of its input after it)."""
    first = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
    first = re.sub(r"^/dev/stdin:[0-9:-]+: ", "", first)  # where in nft's input: per node
    return f"IPv{family} not programmed on this node: the kernel refuses its rules: {first[:500]}"
