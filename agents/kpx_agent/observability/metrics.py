"""Prometheus metrics: every metric upstream kube-proxy v1.36 registers for the agent's mode,
under its name, labels and buckets (pkg/proxy/metrics/metrics.go, RegisterMetrics(mode)), the
process and API client metrics the kubernetes-mixin Proxy dashboard reads, and kpx's own
(`kpx_*`). docs/metrics.md lists them all, with what each one counts in kpx.

kpx programs both IP families in one sync (one transaction per family): a sync is observed
under `ip_family` IPv4 and IPv6 alike, as upstream's dual-stack proxier (one proxier per
family) observes one sync per family.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..model.types import NodeLocalState

# Upstream's component-base exposition has no `_created` samples.
prometheus_client.disable_created_metrics()

#: ip_family label values (upstream: v1.IPFamily).
FAMILY_LABELS: Mapping[int, str] = {4: "IPv4", 6: "IPv6"}
FAMILIES = tuple(FAMILY_LABELS)


def _exponential(start: float, factor: float, count: int) -> tuple[float, ...]:
    return tuple(start * factor**i for i in range(count))


def _linear(start: float, width: float, count: int) -> tuple[float, ...]:
    return tuple(start + width * i for i in range(count))


#: metrics.ExponentialBuckets(0.001, 2, 15): 1 ms .. 16.384 s.
SYNC_BUCKETS = _exponential(0.001, 2, 15)
#: NetworkProgrammingLatency's MergeBuckets(Linear(0.25, 0.25, 2), Linear(1, 1, 59),
#: Linear(60, 5, 12), Linear(120, 30, 7)).
PROGRAMMING_BUCKETS = tuple(
    sorted(
        {
            *_linear(0.25, 0.25, 2),
            *_linear(1, 1, 59),
            *_linear(60, 5, 12),
            *_linear(120, 30, 7),
        }
    )
)
#: client-go's rest_client_request_duration_seconds (component-base restclient metrics).
REST_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)

# -- upstream's names, by where RegisterMetrics registers them --------------------------------
SYNC_DURATION = "kubeproxy_sync_proxy_rules_duration_seconds"
FULL_SYNC_DURATION = "kubeproxy_sync_full_proxy_rules_duration_seconds"
PARTIAL_SYNC_DURATION = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
LAST_QUEUED = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
NETWORK_PROGRAMMING = "kubeproxy_network_programming_duration_seconds"
ENDPOINT_CHANGES_PENDING = "kubeproxy_sync_proxy_rules_endpoint_changes_pending"
ENDPOINT_CHANGES_TOTAL = "kubeproxy_sync_proxy_rules_endpoint_changes_total"
SERVICE_CHANGES_PENDING = "kubeproxy_sync_proxy_rules_service_changes_pending"
SERVICE_CHANGES_TOTAL = "kubeproxy_sync_proxy_rules_service_changes_total"
HEALTHZ_TOTAL = "kubeproxy_proxy_healthz_total"
LIVEZ_TOTAL = "kubeproxy_proxy_livez_total"
NO_LOCAL_ENDPOINTS = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
RESTORE_FAILURES = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
PARTIAL_RESTORE_FAILURES = "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total"
IPTABLES_RULES = "kubeproxy_sync_proxy_rules_iptables_total"
IPTABLES_RULES_LAST = "kubeproxy_sync_proxy_rules_iptables_last"
NFT_SYNC_FAILURES = "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"
NFT_CLEANUP_FAILURES = "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total"
CONNTRACK_DURATION = "kubeproxy_conntrack_reconciler_sync_duration_seconds"
CONNTRACK_DELETED = "kubeproxy_conntrack_reconciler_deleted_entries_total"
CT_INVALID_DROPPED = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total"
LOCALHOST_NODEPORTS_ACCEPTED = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"

UPSTREAM_COMMON = (
    SYNC_DURATION,
    LAST_QUEUED,
    LAST_SYNC,
    ENDPOINT_CHANGES_PENDING,
    ENDPOINT_CHANGES_TOTAL,
    SERVICE_CHANGES_PENDING,
    SERVICE_CHANGES_TOTAL,
    HEALTHZ_TOTAL,
    LIVEZ_TOTAL,
    NETWORK_PROGRAMMING,
    NO_LOCAL_ENDPOINTS,
)
UPSTREAM_BY_MODE: Mapping[str, tuple[str, ...]] = {
    "iptables": (
        CT_INVALID_DROPPED,
        LOCALHOST_NODEPORTS_ACCEPTED,
        FULL_SYNC_DURATION,
        PARTIAL_SYNC_DURATION,
        RESTORE_FAILURES,
        PARTIAL_RESTORE_FAILURES,
        IPTABLES_RULES,
        IPTABLES_RULES_LAST,
        CONNTRACK_DURATION,
        CONNTRACK_DELETED,
    ),
    "ipvs": (RESTORE_FAILURES, CONNTRACK_DURATION, CONNTRACK_DELETED),
    "nftables": (
        FULL_SYNC_DURATION,
        PARTIAL_SYNC_DURATION,
        NFT_SYNC_FAILURES,
        NFT_CLEANUP_FAILURES,
        CONNTRACK_DURATION,
        CONNTRACK_DELETED,
    ),
}


def upstream_names(mode: str) -> tuple[str, ...]:
    """What upstream kube-proxy registers in `mode` (state-only and plugin modes: the
    common ones)."""
    return (*UPSTREAM_COMMON, *UPSTREAM_BY_MODE.get(mode, ()))


#: Upstream's counters from iptables rule counters (nfacct upstream): name -> help.
PACKET_COUNTERS = {
    CT_INVALID_DROPPED: "packets dropped by iptables to work around conntrack problems",
    LOCALHOST_NODEPORTS_ACCEPTED: "Number of packets accepted on nodeports of loopback interface",
}


class _Callback(Collector):
    """Samples read when scraped: `read` gives (kind, name, help, labels, {label values:
    value}) tuples; kinds "counter" and "gauge"."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, str, list[str], Any]]]):
        self.read = read

    def collect(self) -> Iterable[Any]:
        for kind, name, text, labels, values in self.read():
            family: Any
            if kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), text, labels=labels)
            else:
                family = GaugeMetricFamily(name, text, labels=labels)
            for label_values, value in values.items():
                family.add_metric(list(label_values), value)
            yield family


def _tasks_and_threads() -> float:
    """Concurrent units of work in the agent: asyncio tasks of the running loops plus threads
    (kpx's stand-in for go_goroutines)."""
    tasks = 0
    for loop in _LOOPS:
        if not loop.is_closed():
            tasks += len(asyncio.all_tasks(loop))
    return float(tasks + threading.active_count())


_LOOPS: list[asyncio.AbstractEventLoop] = []


def watch_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Count this event loop's tasks in go_goroutines."""
    if loop not in _LOOPS:
        _LOOPS[:] = [lp for lp in _LOOPS if not lp.is_closed()] + [loop]


class AgentMetrics:
    """The agent's registry. Upstream's metrics are made for every mode and registered for
    `mode` (`serve_mode` adds another mode's after a rollback: upstream registers one mode's
    per process)."""

    def __init__(self, mode: str = "nftables") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._registered: set[str] = set()
        fam = ["ip_family"]
        self.sync_duration = Histogram(
            SYNC_DURATION,
            "SyncProxyRules latency in seconds",
            fam,
            buckets=SYNC_BUCKETS,
            registry=None,
        )
        self.full_sync_duration = Histogram(
            FULL_SYNC_DURATION,
            "SyncProxyRules latency in seconds for full resyncs",
            fam,
            buckets=SYNC_BUCKETS,
            registry=None,
        )
        self.partial_sync_duration = Histogram(
            PARTIAL_SYNC_DURATION,
            "SyncProxyRules latency in seconds for partial resyncs",
            fam,
            buckets=SYNC_BUCKETS,
            registry=None,
        )
        self.network_programming = Histogram(
            NETWORK_PROGRAMMING,
            "In Cluster Network Programming Latency in seconds",
            fam,
            buckets=PROGRAMMING_BUCKETS,
            registry=None,
        )
        self.last_sync = Gauge(
            LAST_SYNC, "The last time proxy rules were successfully synced", fam, registry=None
        )
        self.last_queued = Gauge(
            LAST_QUEUED, "The last time a sync of proxy rules was queued", fam, registry=None
        )
        self.endpoint_changes_pending = Gauge(
            ENDPOINT_CHANGES_PENDING, "Pending proxy rules Endpoint changes", registry=None
        )
        self.endpoint_changes = Counter(
            ENDPOINT_CHANGES_TOTAL, "Cumulative proxy rules Endpoint changes", registry=None
        )
        self.service_changes_pending = Gauge(
            SERVICE_CHANGES_PENDING, "Pending proxy rules Service changes", registry=None
        )
        self.service_changes = Counter(
            SERVICE_CHANGES_TOTAL, "Cumulative proxy rules Service changes", registry=None
        )
        self.healthz_total = Counter(
            HEALTHZ_TOTAL, "Cumulative proxy healthz HTTP status", ["code"], registry=None
        )
        self.livez_total = Counter(
            LIVEZ_TOTAL, "Cumulative proxy livez HTTP status", ["code"], registry=None
        )
        self.no_local_endpoints = Gauge(
            NO_LOCAL_ENDPOINTS,
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy", "ip_family"],
            registry=None,
        )
        self.restore_failures = Counter(
            RESTORE_FAILURES, "Cumulative proxy iptables restore failures", fam, registry=None
        )
        self.partial_restore_failures = Counter(
            PARTIAL_RESTORE_FAILURES,
            "Cumulative proxy iptables partial restore failures",
            fam,
            registry=None,
        )
        self.iptables_rules = Gauge(
            IPTABLES_RULES,
            "Total number of iptables rules owned by kube-proxy",
            ["table", "ip_family"],
            registry=None,
        )
        self.iptables_rules_last = Gauge(
            IPTABLES_RULES_LAST,
            "Number of iptables rules written by kube-proxy in last sync",
            ["table", "ip_family"],
            registry=None,
        )
        self.nft_sync_failures = Counter(
            NFT_SYNC_FAILURES, "Cumulative proxy nftables sync failures", fam, registry=None
        )
        self.nft_cleanup_failures = Counter(
            NFT_CLEANUP_FAILURES, "Cumulative proxy nftables cleanup failures", fam, registry=None
        )
        self.conntrack_duration = Histogram(
            CONNTRACK_DURATION,
            "ReconcileConntrackFlowsLatency latency in seconds",
            fam,
            buckets=SYNC_BUCKETS,
            registry=None,
        )
        self.conntrack_deleted = Counter(
            CONNTRACK_DELETED,
            "Cumulative conntrack flows deleted by conntrack reconciler",
            fam,
            registry=None,
        )
        #: Reads the iptables rule counters standing for upstream's nfacct counters (the
        #: iptables backend's `packet_counts`), in a worker thread at each scrape.
        self.packet_counts: Callable[[], Mapping[str, float]] | None = None
        self._packets = _Callback(self._read_packet_counters)
        self._upstream: dict[str, Collector] = {
            SYNC_DURATION: self.sync_duration,
            FULL_SYNC_DURATION: self.full_sync_duration,
            PARTIAL_SYNC_DURATION: self.partial_sync_duration,
            NETWORK_PROGRAMMING: self.network_programming,
            LAST_SYNC: self.last_sync,
            LAST_QUEUED: self.last_queued,
            ENDPOINT_CHANGES_PENDING: self.endpoint_changes_pending,
            ENDPOINT_CHANGES_TOTAL: self.endpoint_changes,
            SERVICE_CHANGES_PENDING: self.service_changes_pending,
            SERVICE_CHANGES_TOTAL: self.service_changes,
            HEALTHZ_TOTAL: self.healthz_total,
            LIVEZ_TOTAL: self.livez_total,
            NO_LOCAL_ENDPOINTS: self.no_local_endpoints,
            RESTORE_FAILURES: self.restore_failures,
            PARTIAL_RESTORE_FAILURES: self.partial_restore_failures,
            IPTABLES_RULES: self.iptables_rules,
            IPTABLES_RULES_LAST: self.iptables_rules_last,
            NFT_SYNC_FAILURES: self.nft_sync_failures,
            NFT_CLEANUP_FAILURES: self.nft_cleanup_failures,
            CONNTRACK_DURATION: self.conntrack_duration,
            CONNTRACK_DELETED: self.conntrack_deleted,
        }
        # Every per-family series exists from the start (0 until something happens), so that
        # a dashboard's rate() has a series to start from.
        for label in FAMILY_LABELS.values():
            for metric in (
                self.sync_duration,
                self.full_sync_duration,
                self.partial_sync_duration,
                self.network_programming,
                self.last_sync,
                self.last_queued,
                self.restore_failures,
                self.partial_restore_failures,
                self.nft_sync_failures,
                self.nft_cleanup_failures,
                self.conntrack_duration,
                self.conntrack_deleted,
            ):
                metric.labels(label)
            for policy in ("internal", "external"):
                self.no_local_endpoints.labels(policy, label)
        for code in ("200", "503"):
            self.healthz_total.labels(code)
            self.livez_total.labels(code)

        # -- process and API client (the kubernetes-mixin Proxy dashboard) --------------------
        ProcessCollector(registry=r)
        self.goroutines = Gauge(
            "go_goroutines",
            "Concurrent units of work: asyncio tasks plus threads (kpx has no goroutines)",
            registry=r,
        )
        self.goroutines.set_function(_tasks_and_threads)
        self.rest_requests = Counter(
            "rest_client_requests_total",
            "Number of HTTP requests, partitioned by status code, method, and host.",
            ["code", "method", "host"],
            registry=r,
        )
        self.rest_duration = Histogram(
            "rest_client_request_duration_seconds",
            "Request latency in seconds. Broken down by verb, and host.",
            ["verb", "host"],
            buckets=REST_BUCKETS,
            registry=r,
        )

        # -- kpx's own ------------------------------------------------------------------------
        self.kpx_sync_failures = Counter(
            "kpx_sync_failures_total",
            "Syncs that failed; the previous rules stayed in place",
            ["mode"],
            registry=r,
        )
        self.changed_ports = Counter(
            "kpx_sync_changed_service_ports_total",
            "Service ports (per IP family) whose programmed state a sync changed",
            registry=r,
        )
        self.forced_full_syncs = Counter(
            "kpx_forced_full_syncs_total",
            "Full syncs the periodic check asked for, by why: rules_gone, drift (changed "
            "behind the agent's back), periodic (hourly)",
            ["reason"],
            registry=r,
        )
        self.services = Gauge(
            "kpx_service_ports", "Service ports in the node-local state", registry=r
        )
        self.kernel_elements = Gauge(
            "kpx_programmed_elements", "Set and map elements the backend programmed", registry=r
        )
        self.watch_bytes = Counter(
            "kpx_watch_received_bytes_total",
            "Bytes received from the apiserver (lists and watches)",
            ["resource"],
            registry=r,
        )
        self.watch_objects = Counter(
            "kpx_watch_received_objects_total",
            "Objects received from the apiserver (list items and watch events)",
            ["resource"],
            registry=r,
        )
        self.watch_idle_timeouts = Counter(
            "kpx_watch_idle_timeouts_total",
            "Watches dropped after receiving nothing for the idle timeout (then resumed)",
            ["resource"],
            registry=r,
        )
        self.service_problems = Gauge(
            "kpx_service_problems",
            "Services the agent programs only in part or not at all, by reason "
            "(each also a Warning Event on the Service)",
            ["reason"],
            registry=r,
        )
        self.excluded_namespaces = Gauge(
            "kpx_opted_out_namespaces", "Namespaces not proxied (opt-out)", registry=r
        )
        self.conntrack_apply_failures = Counter(
            "kpx_conntrack_apply_failures_total",
            "Conntrack settings (spec.conntrack) the agent could not write to the node",
            ["setting"],
            registry=r,
        )
        self.conntrack_not_applied = Gauge(
            "kpx_conntrack_settings_not_applied",
            "Conntrack settings that the last attempt left unapplied (0: all as configured)",
            registry=r,
        )
        self.conntrack_delete_failures = Counter(
            "kpx_conntrack_delete_failures_total",
            "Stale UDP conntrack flow deletions that failed (the conntrack reconciler's)",
            registry=r,
        )
        self.rolled_back = Gauge(
            "kpx_rolled_back",
            "1 while this agent serves with the mode before a switch (to) because its own "
            "(mode) had no verified sync within the deadline (docs/migrating.md)",
            ["mode", "to"],
            registry=r,
        )
        self.config_reload_failures = Counter(
            "kpx_config_reload_failures_total",
            "Configuration file changes rejected; the previous configuration stays",
            registry=r,
        )
        self.mode = ""
        self.serve_mode(mode)

    # -- registration ---------------------------------------------------------------------------
    def serve_mode(self, mode: str) -> None:
        """Register what upstream registers for `mode` (kept: what another mode registered)."""
        self.mode = mode
        for name in upstream_names(mode):
            if name in self._registered:
                continue
            if name in PACKET_COUNTERS:
                if not any(n in self._registered for n in PACKET_COUNTERS):
                    self.registry.register(self._packets)
            else:
                self.registry.register(self._upstream[name])
            self._registered.add(name)

    def _read_packet_counters(self) -> Iterable[tuple[str, str, str, list[str], Any]]:
        counts = self.packet_counts() if self.packet_counts is not None else {}
        for name, text in PACKET_COUNTERS.items():
            yield "counter", name, text, [], {(): float(counts.get(name, 0.0))}

    # -- what happened ---------------------------------------------------------------------------
    def synced(self, full: bool, duration: float, now: float) -> None:
        """A successful sync (both families), `duration` seconds, ended at `now` (epoch)."""
        detail = self.full_sync_duration if full else self.partial_sync_duration
        for label in FAMILY_LABELS.values():
            self.sync_duration.labels(label).observe(duration)
            detail.labels(label).observe(duration)
            self.last_sync.labels(label).set(now)

    def queued(self) -> None:
        for label in FAMILY_LABELS.values():
            self.last_queued.labels(label).set_to_current_time()

    def sync_failed(self, mode: str, families: Iterable[int], partial: bool) -> None:
        """A sync that failed in these families: upstream's failure counter of `mode`."""
        self.kpx_sync_failures.labels(mode).inc()
        for family in families:
            label = FAMILY_LABELS[family]
            if mode == "nftables":
                self.nft_sync_failures.labels(label).inc()
            elif mode in ("iptables", "ipvs"):
                self.restore_failures.labels(label).inc()
                if partial and mode == "iptables":
                    self.partial_restore_failures.labels(label).inc()

    def conntrack_reconciled(
        self, families: Iterable[int], duration: float, deleted: Mapping[int, int], failures: int
    ) -> None:
        """The stale UDP flows' deletion after a sync (upstream's conntrack reconciler), in
        `families`; `deleted`: the entries deleted since the start, per family."""
        for family in sorted(set(families)):
            self.conntrack_duration.labels(FAMILY_LABELS[family]).observe(duration)
        for family, count in deleted.items():
            self.set_counter(self.conntrack_deleted, (FAMILY_LABELS[family],), count)
        if failures:
            self.conntrack_delete_failures.inc(failures)

    def set_counter(self, counter: Counter, labels: tuple[str, ...], value: float) -> None:
        """Bring a counter up to a total counted elsewhere (never down)."""
        child = counter.labels(*labels) if labels else counter
        delta = value - child._value.get()
        if delta > 0:
            child.inc(delta)

    def rest_request(self, method: str, host: str, code: str, seconds: float) -> None:
        """One request to the apiserver (kpx_kube's observer)."""
        self.rest_requests.labels(code, method, host).inc()
        self.rest_duration.labels(method, host).observe(seconds)


def failed_families(error: str) -> tuple[int, ...]:
    """The IP families a backend's error names ("IPv4: ...; IPv6: ..."); both when it names
    none (a failure before either family's transaction)."""
    named = tuple(f for f, label in FAMILY_LABELS.items() if f"{label}" in error)
    return named or FAMILIES


def no_local_endpoints(local: NodeLocalState) -> dict[tuple[str, int], int]:
    """Service ports with a Local traffic policy whose traffic of that kind is dropped for
    want of a local endpoint while the Service has endpoints elsewhere, per (traffic_policy,
    family), as upstream counts them (every combination present, 0 included)."""
    counts = {(policy, family): 0 for policy in ("internal", "external") for family in FAMILIES}
    for sp in local.services.values():
        if sp.drop_when_no_cluster_endpoints and not sp.cluster_endpoints:
            counts[("internal", sp.family)] += 1
        if sp.drop_when_no_external_endpoints and not sp.external_endpoints:
            counts[("external", sp.family)] += 1
    return counts
