"""The running agent, assembled: watches, the sync loop (sync/loop.py), config reloads, health
and metrics servers, rollback and make-before-break, Events and this node's ProxyNodeState."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kpx_api.constants import (
    CONFIG_GENERATION_KEY,
    FIRST_SYNC_VERIFIED,
    LEFTOVERS_NOT_REMOVED,
    MODE_PREFLIGHT,
    ROLLED_BACK,
    SYNC_FAILED,
)
from kpx_api.errors import ConfigError
from kpx_api.preflight import ModeCheck, format_report
from kpx_kube import AlreadyExists, ApiError, Client, collector
from kpx_kube.recovery import Recovery
from kpx_kube.reflector import Reflector, Resource

from . import __version__
from . import settings as settings_mod
from .backends.base import Backend
from .conntrack import sysctl as conntrack_sysctl
from .handover.make_before_break import Leftover, LeftoverRemoval
from .handover.rollback import rollback_due, rolled_back_message, seconds_left
from .model import service_problems
from .model.types import NodeLocalState, ServicePortKey
from .observability import pod_events
from .observability.http_endpoints import RetryingServer, health_app, metrics_app
from .observability.metrics import FAMILY_LABELS, AgentMetrics, no_local_endpoints, watch_loop
from .observability.node_state import DEFAULT_WRITE_INTERVAL, ErrorRecord, NodeFacts, SyncRecord
from .observability.node_state_writer import NodeStateWriter
from .observability.proxy_health import ProxyHealth, health_timeout
from .observability.service_health import HealthCheckServers, health_targets
from .settings import AgentSettings
from .state_api.address import parse_address

if TYPE_CHECKING:
    from .state_api.server import StateServer
from .store.cluster_state import ClusterState
from .store.optout import exclusion_field_selector
from .store.resources import NAMESPACES_RESOURCE, NODES_RESOURCE, SERVICES_RESOURCE, SLICES_RESOURCE
from .sync.loop import SyncLoop, brief_error, sync_failure_due
from .sync.proxier import Proxier, SyncOutcome
from .sync.sync_log import log_sync

log = logging.getLogger(__name__)
CONFIG_POLL_SECONDS = 2.0
#: How long the initial lists may keep the collector paused (collector.wait_paused): they take
#: about 1 s at 10,000 Services and 3 s at 30,000; an apiserver away at the start would keep it
#: off for as long.
INITIAL_LISTS_PAUSE = 30.0


Watch = tuple[Reflector, "asyncio.Task[None]"]


def dead_watches(watches: Iterable[Watch]) -> list[str]:
    """What is wrong with each watch that is dead: its reflector's task ended (it never should),
    or its view may be wrong after an unexpected error until it listed again (Reflector.failure)."""
    dead: list[str] = []
    for reflector, task in watches:
        kind = reflector.resource.kind
        if task.done():
            exc = None if task.cancelled() else task.exception()
            dead.append(f"{kind}: watch stopped" + (f": {exc!r}" if exc is not None else ""))
        elif reflector.failure:
            dead.append(f"{kind}: {reflector.failure}")
    return dead


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        node_name: str,
        client: Client,
        backend: Backend,
        config_path: Path | None = None,
        overrides: dict[str, object] | None = None,
        conntrack_paths: conntrack_sysctl.ConntrackPaths | None = None,
        backend_for: Callable[[AgentSettings], Backend] | None = None,
        node_state_interval: float | None = DEFAULT_WRITE_INTERVAL,
        leftovers_of: Callable[[AgentSettings], list[Leftover]] | None = None,
        preflight: Callable[[], Awaitable[Sequence[ModeCheck]]] | None = None,
    ) -> None:
        self.settings = settings
        self.node_name = node_name
        self.client = client
        #: one for all reflectors: after an apiserver outage they resume within seconds of its
        #: return (a probe of /readyz per second at most), spread over up to 2 s
        self.recovery = Recovery(client.ready)
        self.backend = backend
        self.config_path = config_path
        #: Set once a full sync programmed the kernel without error and the backend then
        #: finds its rules there: what make-before-break waits for (handover/make_before_break.py).
        self.first_sync_verified = asyncio.Event()
        #: Which kpx modes this node can run (handover/preflight.py), checked once at start:
        #: the verdicts go into its ProxyNodeState (status.preflight) and an Event
        #: ModePreflight about its Pod. None: not checked.
        self.preflight = preflight
        self.preflight_checks: tuple[ModeCheck, ...] = ()
        self.overrides = overrides or {}
        #: A backend for a mode's settings (the CLI's, through the backend registry: the agent
        #: core imports no mode's code): what a rollback runs.
        self.backend_for = backend_for
        #: Make-before-break (handover/make_before_break.py): removes what other proxies left, once
        #: `first_sync_verified` is set; `leftovers_of` gives what to remove for a mode's
        #: settings (after a rollback: the rollback mode's). None: nothing to remove.
        self.leftovers_of = leftovers_of
        self.leftover_removal: LeftoverRemoval | None = None
        self._removal_task: asyncio.Task[None] | None = None
        #: The RolledBack message once this agent went back to the mode before a switch.
        self.rolled_back = ""
        #: The latest sync error (brief), for the RolledBack message.
        self._last_error = ""
        self._started = time.monotonic()
        self.conntrack_paths = conntrack_paths or conntrack_sysctl.ConntrackPaths()
        self.pod = pod_events.PodRef.from_env()
        self._conntrack_failed = False
        #: What of spec.conntrack is not applied (its ProxyNodeState), "" when all is.
        self._conntrack_not_applied = ""
        #: (error, monotonic time) of the last SyncFailed Event (rate limit).
        self._sync_failure_told: tuple[str, float] | None = None
        #: Reasons the service-problems metric has shown (set back to 0 when none is left).
        self._problem_reasons: set[str] = set()
        self._conntrack_task: asyncio.Task[None] | None = None  # a reload's apply
        self.metrics = AgentMetrics(settings.mode)
        if leftovers_of is not None:
            self.leftover_removal = LeftoverRemoval(
                leftovers_of(settings),
                self.metrics.registry,
                self.report_event,
                failed_reason=LEFTOVERS_NOT_REMOVED,
            )
        self._count_packets()
        self.state = ClusterState()
        self.proxier = Proxier(
            self.state, backend, node_name, settings.optout, self.metrics, settings.proxy
        )
        self.health_check_servers = HealthCheckServers()
        #: New Service problems (service_problems.py) waiting to be posted as Events.
        self._problem_events: asyncio.Queue[service_problems.ServiceProblem] = asyncio.Queue()
        self.sync_loop = SyncLoop(self)
        self._config_stamp = self._stamp()
        self.health = ProxyHealth(
            health_timeout(settings.sync_period), leftovers_pending=self._leftovers_pending
        )
        #: Every reflector with its task: a dead one fails the health endpoints.
        self.watches: list[Watch] = []
        self.health.dead_watches = lambda: dead_watches(self.watches)
        self.state_server: StateServer | None = None
        if settings.state_api is not None:
            # Imported only here: an agent whose state API is off never loads gRPC.
            from .state_api.publisher import Publisher
            from .state_api.server import StateServer

            self.state_server = StateServer(Publisher(), parse_address(settings.state_api))
            self.proxier.on_synced = self._publish_state
        #: This node's ProxyNodeState (node_state.py): the latest successful sync and error,
        #: and the configuration generation loaded / synced.
        self._last_sync: SyncRecord | None = None
        self._last_error_record: ErrorRecord | None = None
        self._loaded_generation = self._read_generation()
        self._synced_generation: int | None = None
        self.node_state: NodeStateWriter | None = None
        if node_state_interval is not None:
            self.node_state = NodeStateWriter(
                client, node_name, self.node_facts, self._node_uid, node_state_interval
            )

    # -- this node's ProxyNodeState -------------------------------------------------------------
    def _read_generation(self) -> int | None:
        """The ProxyConfiguration generation beside the configuration file (the operator's
        ConfigMap key CONFIG_GENERATION_KEY); None without one."""
        if self.config_path is None:
            return None
        try:
            text = (self.config_path.parent / CONFIG_GENERATION_KEY).read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def _node_uid(self) -> str | None:
        node = self.state.node or {}
        return str((node.get("metadata") or {}).get("uid") or "") or None

    def node_facts(self) -> NodeFacts:
        """What this agent has programmed, for its ProxyNodeState."""
        services = endpoints = 0
        for port in self.proxier.local.services.values():
            services += 1
            if port.external_endpoints == port.cluster_endpoints:
                endpoints += len(port.cluster_endpoints)
            else:
                endpoints += len(set(port.cluster_endpoints) | set(port.external_endpoints))
        removal = self.leftover_removal
        return NodeFacts(
            mode=self.settings.mode,
            agent_version=__version__,
            pod=(self.pod.name, self.pod.namespace, self.pod.uid) if self.pod else None,
            generation=self._synced_generation,
            verified=self.first_sync_verified.is_set(),
            rolled_back=self.rolled_back,
            last_sync=self._last_sync,
            services=services,
            endpoints=endpoints,
            rules=int(self.backend.element_count()),
            last_error=self._last_error_record,
            conntrack_not_applied=self._conntrack_not_applied,
            leftovers=removal.pending_reports() if removal is not None else (),
            takeover_from_kube_proxy=self.settings.takeover_from_kube_proxy and removal is not None,
            preflight=self.preflight_checks,
        )

    async def _check_modes(self, check: Callable[[], Awaitable[Sequence[ModeCheck]]]) -> None:
        """Preflight: the verdicts into the ProxyNodeState, and an Event for people."""
        self.preflight_checks = tuple(await check())
        self._node_state_changed()
        await self._report("Normal", MODE_PREFLIGHT, format_report(self.preflight_checks))

    def _node_state_changed(self) -> None:
        if self.node_state is not None:
            self.node_state.poke()

    def _publish_state(
        self, local: NodeLocalState, changed: Collection[ServicePortKey] | None
    ) -> None:
        """After a successful sync (the proxier's worker thread): a new revision for the
        state API's clients, when anything changed."""
        assert self.state_server is not None
        if self.state_server.publisher.publish(local, self.proxier.settings, changed):
            self.state_server.notify()

    # -- wiring --------------------------------------------------------------------------------
    def _reflector(
        self,
        resource: Resource,
        field_selector: str = "",
        on_event: Callable[[], None] | None = None,
    ) -> Reflector:
        selector = field_selector
        return Reflector(
            self.client,
            resource,
            self.state,
            field_selector=(lambda: selector),
            on_event=on_event or self.sync_loop.wake.set,
            recovery=self.recovery,
        )

    def _queued(self) -> None:
        """A change to program was recorded (upstream's proxier Sync())."""
        self.health.queued_update()
        self.metrics.queued()

    def _on_node_event(self) -> None:
        self.health.sync_node(self.state.node)
        self.sync_loop.wake.set()

    def _excluding_reflector(self, resource: Resource) -> Reflector:
        """Services and EndpointSlices: the apiserver leaves out opted-out namespaces."""
        return Reflector(
            self.client,
            resource,
            self.state,
            field_selector=lambda: exclusion_field_selector(self.proxier.excluded),
            on_event=self.sync_loop.wake.set,
            recovery=self.recovery,
            shrink=functools.partial(self.state.shrink, resource.kind),
        )

    def _count_packets(self) -> None:
        """Upstream's nfacct packet counters, from the backend's rule counters (iptables)."""
        self.metrics.packet_counts = self.backend.packet_counts

    def _publish_metrics(self) -> None:
        """Before a scrape (event loop): what is counted elsewhere, into the registry."""
        m = self.metrics
        for resource, count in self.client.bytes_received.items():
            m.set_counter(m.watch_bytes, (resource,), count)
        for resource, count in self.client.objects_received.items():
            m.set_counter(m.watch_objects, (resource,), count)
        for resource, count in self.client.watch_idle_timeouts.items():
            m.set_counter(m.watch_idle_timeouts, (resource,), count)
        m.kernel_elements.set(self.backend.element_count())
        state = self.state
        m.set_counter(m.service_changes, (), state.service_events)
        m.set_counter(m.endpoint_changes, (), state.slice_events)
        m.service_changes_pending.set(len(state.services_pending))
        m.endpoint_changes_pending.set(len(state.slices_pending))
        for (policy, family), count in no_local_endpoints(self.proxier.local).items():
            m.no_local_endpoints.labels(policy, FAMILY_LABELS[family]).set(count)

    async def run(self) -> None:
        runners = [
            RetryingServer(
                health_app(self.health, self.metrics), *self.settings.healthz, "healthz"
            ),
            RetryingServer(
                metrics_app(
                    self.metrics.registry, self._publish_metrics, lambda: self.backend.mode
                ),
                *self.settings.metrics,
                "metrics",
            ),
        ]
        watch_loop(asyncio.get_running_loop())
        self.client.observer = self.metrics.rest_request
        for runner in runners:
            await runner.start()
        self._started = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        try:
            self._start_leftover_removal()
            if self.state_server is not None:
                await self.state_server.start()
            if self.preflight is not None:
                tasks.append(asyncio.create_task(self._check_modes(self.preflight)))
            tasks.append(asyncio.create_task(self._post_problem_events()))
            if self.node_state is not None:
                tasks.append(asyncio.create_task(self.node_state.run()))
            await self.apply_conntrack()
            namespaces = self._reflector(NAMESPACES_RESOURCE)
            node = self._reflector(
                NODES_RESOURCE, f"metadata.name={self.node_name}", self._on_node_event
            )
            tasks += self._start_watches(namespaces, node)
            await asyncio.gather(namespaces.synced.wait(), node.synced.wait())
            # Know the opted-out namespaces before the first list, so it already leaves them out.
            self.proxier.update_excluded()
            services = self._excluding_reflector(SERVICES_RESOURCE)
            slices = self._excluding_reflector(SLICES_RESOURCE)
            # The initial objects live as long as the agent: no collection while they arrive
            # (for up to INITIAL_LISTS_PAUSE), and the collector kept off them afterwards
            # (frozen, with no collect() first: at 10,000 Services that alone takes a
            # noticeable while).
            tasks += self._start_watches(services, slices)
            await collector.wait_paused(
                asyncio.gather(services.synced.wait(), slices.synced.wait()),
                INITIAL_LISTS_PAUSE,
                freeze=True,
            )
            log.info(
                "initial lists done: %d services, %d endpointslices, %d namespaces opted out",
                len(self.state.services),
                len(self.state.slices),
                len(self.proxier.excluded),
            )
            if self.config_path is not None:
                tasks.append(asyncio.create_task(self._watch_config()))
            # From here on, as upstream once its informers synced, every recorded change is
            # an update the health server waits for (the first sync itself is not queued).
            self.state.on_queued = self._queued
            await self.sync_loop.run((services, slices))
        finally:
            if self._removal_task is not None:
                tasks.append(self._removal_task)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for runner in runners:
                await runner.cleanup()
            await self.health_check_servers.close()
            if self.state_server is not None:
                await self.state_server.stop()
            await self.client.close()

    def _start_watches(self, *reflectors: Reflector) -> list[asyncio.Task[None]]:
        started = [(r, asyncio.create_task(r.run())) for r in reflectors]
        self.watches += started
        return [task for _, task in started]

    # -- the sync loop (sync/loop.py) and what a sync's outcome means -------------------------
    async def after_sync(self, outcome: SyncOutcome) -> None:
        """After each sync (the loop's SyncHost): Service problems, health, healthCheckNodePort
        servers, the first sync's verification, Events and this node's ProxyNodeState."""
        self._queue_problem_events()
        if outcome.ok:
            self._sync_failure_told = None
            self._last_sync = SyncRecord(datetime.now(UTC), outcome.duration, outcome.full)
            self._synced_generation = self._loaded_generation
            self.health.updated()
            if self.state.has_changes():  # recorded while this sync ran: still pending
                self.health.queued_update()
            if outcome.full or outcome.changed_ports:
                await self.health_check_servers.update(health_targets(self.proxier.local))
            if outcome.full and not self.first_sync_verified.is_set():
                await self._verify_first_sync()
            if outcome.full or outcome.changed_ports:
                log_sync(self.backend.mode, outcome, len(self.proxier.local.services))
        else:
            self._last_error = brief_error(outcome.error)
            self._last_error_record = ErrorRecord(
                f"mode {self.settings.mode}: {self._last_error or 'unknown error'}",
                datetime.now(UTC),
            )
            await self._report_sync_failure(outcome.error)
        self._node_state_changed()

    def _queue_problem_events(self) -> None:
        """Publish the Service problems' metric, and queue the new ones for their Events."""
        book = self.proxier.problems
        counts = book.counts()
        for reason in (*counts, *self._problem_reasons):
            self.metrics.service_problems.labels(reason).set(counts.get(reason, 0))
        self._problem_reasons |= set(counts)
        for problem in book.take_new():
            log.warning(
                "service %s/%s: %s: %s",
                problem.namespace,
                problem.name,
                problem.reason,
                problem.message,
            )
            self._problem_events.put_nowait(problem)

    async def _post_problem_events(self) -> None:
        """Post queued Service problems as Warning Events, one at a time, off the sync loop.
        AlreadyExists: another node reported the same problem first (the name is derived from
        it), which is the point."""
        while True:
            problem = await self._problem_events.get()
            body = service_problems.event_body(problem, self.node_name, datetime.now(UTC))
            path = f"/api/v1/namespaces/{problem.namespace}/events"
            try:
                await self.client.create(path, body)
            except AlreadyExists:
                pass
            except ApiError as exc:  # a refusal, or Unreachable: the log line above stays
                log.warning(
                    "event %s on service %s/%s not recorded: %s",
                    problem.reason,
                    problem.namespace,
                    problem.name,
                    exc,
                )

    async def _report_sync_failure(self, error: str) -> None:
        """A Warning Event SyncFailed with the kernel's error: when the error is new, else at
        most once per SYNC_FAILURE_REPORT_INTERVAL (the sync is retried every 1-30 s)."""
        now = time.monotonic()
        error = brief_error(error)
        if not sync_failure_due(self._sync_failure_told, error, now):
            return
        self._sync_failure_told = (error, now)
        await self._report(
            "Warning",
            SYNC_FAILED,
            f"mode {self.settings.mode}: sync failed, keeping the previous rules "
            f"and retrying: {error or 'unknown error'}",
        )

    async def _verify_first_sync(self) -> None:
        """After a successful full sync: set `first_sync_verified` if the backend finds its
        rules in the kernel (backends without that check: the sync's success is the proof)."""
        if not await asyncio.to_thread(self.backend.programmed):
            log.warning("the first sync succeeded but its rules are not in the kernel")
            self.proxier.request_full_sync()
            self.sync_loop.wake.set()
            return
        self.first_sync_verified.set()
        self._node_state_changed()
        if self.rolled_back:
            # Not Ready for good (rolled back); no FirstSyncVerified: the node did not switch.
            log.info("mode %s (rolled back) verified: its rules are programmed", self.settings.mode)
            return
        log.info("first sync verified: own rules programmed")
        self.health.verified_first_sync()
        await self._report(
            "Normal",
            FIRST_SYNC_VERIFIED,
            f"mode {self.settings.mode}: own rules programmed and found in the "
            "kernel; this agent serves its node",
        )

    # -- rollback (rollback.py) -----------------------------------------------------------------
    def _start_leftover_removal(self) -> None:
        if self.leftover_removal is not None:
            removal = self.leftover_removal
            self._removal_task = asyncio.create_task(removal.run(self.first_sync_verified))

    def _leftovers_pending(self) -> str:
        """Why readiness waits for leftovers: the switch's old mode's rules are still here."""
        removal = self.leftover_removal
        return removal.blocking(self.switching_from()) if removal is not None else ""

    def switching_from(self) -> set[str]:
        """The mode a running switch comes from (the configuration's rollback), whose rules'
        removal readiness waits for; none after a rollback (not Ready anyway)."""
        rollback = self.settings.rollback
        return {rollback.settings.mode} if rollback is not None and not self.rolled_back else set()

    def rollback_left(self) -> float | None:
        """Seconds until this agent rolls back (0: now), None when it will not."""
        return seconds_left(
            self.settings.rollback,
            self.first_sync_verified.is_set(),
            bool(self.rolled_back),
            time.monotonic() - self._started,
        )

    async def roll_back(self) -> bool:
        """Go back to the rollback mode, in process (between syncs: nothing programs now):
        its backend from now on, a full sync of it next (its rules are still in the kernel:
        nothing removed them), what this mode left removed once that sync is verified, not
        Ready for good. Whether it rolled back (False: not due; or the rollback mode's backend
        could not be made, said in the log and in /readyz, and not tried again: this mode keeps
        retrying, not Ready)."""
        rollback = self.settings.rollback
        running_for = time.monotonic() - self._started
        if (
            not rollback_due(
                rollback, self.first_sync_verified.is_set(), bool(self.rolled_back), running_for
            )
            or rollback is None
        ):
            return False
        failed, to = self.settings.mode, rollback.settings.mode
        message = rolled_back_message(failed, rollback.deadline, self._last_error, to)
        try:
            if self.backend_for is None:
                raise RuntimeError("this agent cannot start another mode's backend")
            backend = self.backend_for(rollback.settings)
        except Exception as exc:
            log.error("cannot roll back to mode %s: %s", to, exc)
            self.rolled_back = f"{failed} never synced and rolling back to {to} failed: {exc}"
            self.health.rolled_back = self.rolled_back
            return False
        log.warning("rolling back: %s", message)
        self.rolled_back = message
        self.health.rolled_back = message
        self.metrics.rolled_back.labels(failed, to).set(1)
        self.metrics.serve_mode(to)
        self.backend = backend
        self.proxier.backend, self.proxier.settings = backend, rollback.settings.proxy
        self._count_packets()
        self.settings = rollback.settings
        self.health.timeout = health_timeout(self.settings.sync_period)
        self._sync_failure_told = None
        self.proxier.request_full_sync(f"rolled back to mode {to}")
        # Make-before-break again, for the rollback mode: what `failed` left goes once the
        # rollback mode's rules are verified in the kernel.
        if self._removal_task is not None:
            self._removal_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._removal_task
            self._removal_task = None
        self.first_sync_verified = asyncio.Event()
        if self.leftover_removal is not None and self.leftovers_of is not None:
            self.leftover_removal.reset(self.leftovers_of(self.settings))
            self._start_leftover_removal()
        self._node_state_changed()
        await self._report("Warning", ROLLED_BACK, message)
        return True

    # -- live configuration --------------------------------------------------------------------
    def _stamp(self) -> bytes:
        if self.config_path is None:
            return b""
        try:
            generation = self.config_path.parent / CONFIG_GENERATION_KEY
            extra = generation.read_bytes() if generation.exists() else b""
            return self.config_path.read_bytes() + b"\0" + extra
        except OSError:
            return b""

    async def _watch_config(self) -> None:
        while True:
            await asyncio.sleep(CONFIG_POLL_SECONDS)
            stamp = self._stamp()
            if stamp == self._config_stamp:
                continue
            self._config_stamp = stamp
            self.reload_config()

    def reload_config(self) -> bool:
        """Apply a changed configuration file; a bad one is refused and the old one stays."""
        try:
            config = settings_mod.load(self.settings.mode, self.config_path, self.overrides)
            new = settings_mod.resolve(config)
        except ConfigError as exc:
            self.metrics.config_reload_failures.inc()
            log.error("configuration change refused, keeping the previous one: %s", exc)
            return False
        if self.rolled_back:
            # Serving the rollback mode: its settings come from the configuration's rollback
            # (or from the configuration itself once spec.mode is set back to it).
            fallback = (
                new
                if new.mode == self.settings.mode
                else (new.rollback.settings if new.rollback is not None else None)
            )
            if fallback is None or fallback.mode != self.settings.mode:
                log.info(
                    "configuration changed; rolled back to mode %s, keeping its settings",
                    self.settings.mode,
                )
                return False
            new = fallback
        elif new.mode != self.settings.mode:
            self.metrics.config_reload_failures.inc()
            log.error(
                "mode changed to %s: that needs a new agent; keeping %s",
                new.mode,
                self.settings.mode,
            )
            return False
        self.health.timeout = health_timeout(new.sync_period)
        if (new.healthz, new.metrics, new.state_api) != (
            self.settings.healthz,
            self.settings.metrics,
            self.settings.state_api,
        ):
            log.warning("bind address and state API changes take effect when the agent restarts")
        if new.conntrack != self.settings.conntrack:
            self._conntrack_task = asyncio.get_running_loop().create_task(self.apply_conntrack(new))
        if new.proxy != self.settings.proxy:
            self.proxier.reconfigure(new.proxy)
        self.proxier.optout = new.optout
        self.settings = new
        self._loaded_generation = self._read_generation()
        if not self.state.has_changes():  # nothing to sync for it: in effect now
            self._synced_generation = self._loaded_generation
        log.info("configuration reloaded")
        self.sync_loop.wake.set()
        self._node_state_changed()
        return True

    # -- the node's conntrack settings ---------------------------------------------------------
    async def apply_conntrack(self, settings: AgentSettings | None = None) -> None:
        """Set the node's conntrack sysctls (spec.conntrack); report what could not be set in
        the log, the metrics and an Event on this agent's Pod (the operator's status shows it)."""
        conntrack = (settings or self.settings).conntrack
        outcome = await asyncio.to_thread(conntrack_sysctl.apply, conntrack, self.conntrack_paths)
        self.metrics.conntrack_not_applied.set(len(outcome.failures))
        for failure in outcome.failures:
            self.metrics.conntrack_apply_failures.labels(failure.partition(":")[0]).inc()
        self._conntrack_not_applied = "; ".join(outcome.failures)
        self._node_state_changed()
        if outcome.failures:
            message = "conntrack settings not applied: " + "; ".join(outcome.failures)
            await self._report("Warning", pod_events.CONNTRACK_NOT_APPLIED, message)
        elif outcome.changed or self._conntrack_failed:
            changes = ", ".join(f"{w.setting}={w.value}" for w in outcome.changed)
            await self._report(
                "Normal",
                pod_events.CONNTRACK_APPLIED,
                f"conntrack settings applied ({changes or 'already as configured'})",
            )
        self._conntrack_failed = bool(outcome.failures)

    async def report_event(self, type_: str, reason: str, message: str) -> None:
        """An Event about this agent's Pod (none when the Pod is unknown: started by hand)."""
        await self._report(type_, reason, message)

    async def _report(self, type_: str, reason: str, message: str) -> None:
        if self.pod is None:
            return
        body = pod_events.event_body(
            self.pod, self.node_name, type_, reason, message, datetime.now(UTC)
        )
        await pod_events.post_event(self.client, body)
