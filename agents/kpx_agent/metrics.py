"""Prometheus metrics, under kube-proxy's names where one exists."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = tuple(0.001 * 2**i for i in range(15))  # 1 ms .. ~16 s, as upstream
_PROGRAMMING_BUCKETS = (
    *(0.25 * i for i in range(1, 20)),
    *(5.0 * i for i in range(1, 13)),
    *(60.0 * i for i in range(2, 11)),
)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            buckets=_BUCKETS,
            registry=r,
        )
        self.full_sync_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            buckets=_BUCKETS,
            registry=r,
        )
        self.partial_sync_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            buckets=_BUCKETS,
            registry=r,
        )
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In-cluster network programming latency in seconds",
            buckets=_PROGRAMMING_BUCKETS,
            registry=r,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            registry=r,
        )
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            registry=r,
        )
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "Cumulative proxy rules Service changes",
            registry=r,
        )
        self.sync_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            "Cumulative proxy rules restore failures (all modes)",
            registry=r,
        )
        self.kpx_sync_failures = Counter(
            "kpx_sync_failures_total",
            "Syncs that failed; the previous rules stayed in place",
            ["mode"],
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
        self.watch_bytes = Gauge(
            "kpx_watch_received_bytes",
            "Bytes received from the apiserver (lists and watches)",
            ["resource"],
            registry=r,
        )
        self.watch_objects = Gauge(
            "kpx_watch_received_objects",
            "Objects received from the apiserver (list items and watch events)",
            ["resource"],
            registry=r,
        )
        self.watch_idle_timeouts = Gauge(
            "kpx_watch_idle_timeouts",
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
        self.healthz_total = Counter(
            "kubeproxy_proxy_healthz_total",
            "Cumulative proxy healthz HTTP status",
            ["code"],
            registry=r,
        )
        self.livez_total = Counter(
            "kubeproxy_proxy_livez_total",
            "Cumulative proxy livez HTTP status",
            ["code"],
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
