"""One sync, with a recording backend: what is recomputed, what the backend is told, and what
happens on failure."""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Collection, Iterable
from typing import Any

import pytest

from kpx_agent.backends.base import Backend, BackendError, KernelReadBack
from kpx_agent.conntrack import stale_flows as conntrack
from kpx_agent.conntrack.stale_flows import FlowFilter
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    DetectLocal,
    DetectLocalMode,
    NodeLocalState,
    Protocol,
    ServicePortKey,
)
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.proxier import DRIFT, GONE, PERIODIC, KernelFinding, Proxier
from kpx_api.proxysettings import NamespaceOptOut


class RecordingBackend(Backend):
    mode = "test"

    def __init__(self) -> None:
        self.calls: list[tuple[set[str], bool]] = []
        self.fail_next = False

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        if self.fail_next:
            self.fail_next = False
            raise BackendError("no")
        keys = {f"{k.namespace}/{k.name}/{k.protocol}" for k in (changed or state.services)}
        self.calls.append((keys, changed is None))

    def cleanup(self) -> None:
        pass

    def reconfigure(self, settings: DataplaneSettings) -> None:
        pass


def service(ns: str, name: str, proto: str = "TCP") -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name},
        "spec": {"clusterIPs": ["10.96.0.10"], "ports": [{"port": 53, "protocol": proto}]},
    }


def endpoint_slice(ns: str, svc: str, *ips: str, proto: str = "TCP") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": ns,
            "name": f"{svc}-1",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "ports": [{"port": 5353, "protocol": proto}],
        "endpoints": [{"addresses": [ip]} for ip in ips],
    }


def setup() -> tuple[ClusterState, RecordingBackend, Proxier, list[FlowFilter]]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    backend = RecordingBackend()
    flows: list[FlowFilter] = []

    def record(filters: Iterable[FlowFilter]) -> int:
        flows.extend(filters)
        return 0

    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), DataplaneSettings())
    proxier.delete_flows = record
    return state, backend, proxier, flows


def test_first_sync_is_full_then_only_changed_services() -> None:
    state, backend, proxier, _ = setup()
    state.upsert(SERVICES, service("a", "web"))
    state.upsert(SERVICES, service("a", "api"))
    assert proxier.sync().full
    state.upsert(SLICES, endpoint_slice("a", "web", "10.244.1.2"))
    outcome = proxier.sync()
    assert not outcome.full and backend.calls[-1] == ({"a/web/tcp"}, False)


def test_failure_keeps_changes_and_forces_a_full_sync() -> None:
    state, backend, proxier, _ = setup()
    state.upsert(SERVICES, service("a", "web"))
    proxier.sync()
    backend.fail_next = True
    backend.mode = "iptables"  # upstream's failure counters are per mode
    proxier.metrics.serve_mode("iptables")
    state.upsert(SLICES, endpoint_slice("a", "web", "10.244.1.2"))
    outcome = proxier.sync()
    assert not outcome.ok
    sample = proxier.metrics.registry.get_sample_value
    for family in ("IPv4", "IPv6"):  # the error names no family: both failed
        assert (
            sample(
                "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", {"ip_family": family}
            )
            == 1
        )
        # A partial sync's failure: the next sync is a full one (upstream's fallback).
        assert (
            sample(
                "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                {"ip_family": family},
            )
            == 1
        )
    assert sample("kpx_sync_failures_total", {"mode": "iptables"}) == 1
    assert proxier.sync().full  # the retry reprograms everything
    assert "10.244.1.2" in str(proxier.local.services)


def test_opted_out_namespace_is_removed_and_restored() -> None:
    state, _, proxier, _ = setup()
    state.upsert(NAMESPACES, {"metadata": {"name": "a"}})
    state.upsert(SERVICES, service("a", "web"))
    proxier.sync()
    assert len(proxier.local.services) == 1
    labelled = {"metadata": {"name": "a", "labels": {"networking.k8s.io/kube-proxy": "disabled"}}}
    state.upsert(NAMESPACES, labelled)
    proxier.sync()
    assert proxier.excluded == {"a"} and proxier.local.services == {}
    state.upsert(NAMESPACES, {"metadata": {"name": "a"}})
    proxier.sync()
    assert proxier.excluded == frozenset() and len(proxier.local.services) == 1


def test_udp_endpoint_removal_cleans_conntrack_after_the_sync() -> None:
    state, _, proxier, flows = setup()
    state.upsert(SERVICES, service("k", "dns", "UDP"))
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.1.2", "10.244.2.2", proto="UDP"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    flows.clear()  # 0 -> 2 endpoints cleaned the VIP's entries; not what this test is about
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.2.2", proto="UDP"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    assert [str(f.dnat_to) for f in flows] == ["10.244.1.2"]


def test_a_first_programmed_udp_port_keeps_only_entries_dnated_to_its_serving_endpoints() -> None:
    """At the agent's start (and for a port new since), the entries to a UDP port's addresses
    that are DNATed to an address that is not a serving endpoint go: a pod gone while no
    agent ran. A serving-terminating endpoint the rules no longer use (a ready one exists)
    still serves its flows, as upstream keeps them; a not-serving one does not."""
    state, _, proxier, flows = setup()
    state.upsert(SERVICES, service("k", "dns", "UDP"))
    sl = endpoint_slice("k", "dns", "10.244.1.2", "10.244.2.2", "10.244.3.2", proto="UDP")
    sl["endpoints"][1]["conditions"] = {"ready": False, "serving": True, "terminating": True}
    sl["endpoints"][2]["conditions"] = {"ready": False, "serving": False, "terminating": True}
    state.upsert(SLICES, sl)
    state.upsert(SERVICES, service("k", "web", "TCP"))
    state.upsert(SLICES, endpoint_slice("k", "web", "10.244.1.3"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    reconcile = [f for f in flows if f.keep is not None]
    assert [(str(f.dst), f.port, f.keep) for f in reconcile] == [
        ("10.96.0.10", 53, frozenset({"10.244.1.2", "10.244.2.2"}))
    ]
    assert [
        str(ep.ip) for ep in proxier.local.services[reconcile_key(proxier)].cluster_endpoints
    ] == ["10.244.1.2"]  # the rules use the ready endpoint only
    flows.clear()
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.2.2", proto="UDP"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    assert [f.keep for f in flows] == [None]  # a change after that: `stale_flows` only


def test_a_udp_node_port_first_programmed_leaves_other_services_entries_on_its_port() -> None:
    """A NodePort's reconcile matches its port on any address: the entries to another UDP
    Service's ClusterIP on the same port number are that Service's, not the NodePort's."""
    state, _, proxier, flows = setup()
    node_port = service("k", "np", "UDP")
    node_port["spec"].update(type="NodePort", clusterIPs=["10.96.0.20"])
    node_port["spec"]["ports"][0]["nodePort"] = 30053
    other = service("k", "other", "UDP")
    other["spec"].update(clusterIPs=["10.96.0.30"], ports=[{"port": 30053, "protocol": "UDP"}])
    for svc in (node_port, other):
        state.upsert(SERVICES, svc)
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    reconcile = {(str(f.dst), f.port): f.skip_dsts for f in flows if f.keep is not None}
    assert reconcile == {
        ("10.96.0.20", 53): frozenset(),
        ("None", 30053): frozenset({"10.96.0.30"}),
        ("10.96.0.30", 30053): frozenset(),
    }


def reconcile_key(proxier: Proxier) -> ServicePortKey:
    (key,) = [k for k in proxier.local.services if k.protocol is Protocol.UDP]
    return key


def test_the_conntrack_cleanup_is_upstreams_conntrack_reconciler_in_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, _, proxier, _ = setup()
    deleted: Counter[int] = Counter()
    monkeypatch.setattr(conntrack, "deleted_by_family", deleted)

    def delete(filters: Iterable[FlowFilter]) -> int:
        for f in filters:
            deleted[f.family] += 3  # as conntrack reported it
        return 1  # one deletion failed

    proxier.delete_flows = delete
    state.upsert(SERVICES, service("k", "dns", "UDP"))
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.1.2", "10.244.2.2", proto="UDP"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.2.2", proto="UDP"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    sample = proxier.metrics.registry.get_sample_value
    runs = "kubeproxy_conntrack_reconciler_sync_duration_seconds_count"
    assert sample(runs, {"ip_family": "IPv4"}) == 2  # both syncs changed UDP ports
    assert sample(runs, {"ip_family": "IPv6"}) == 0  # no IPv6 flow to delete
    total = sample("kubeproxy_conntrack_reconciler_deleted_entries_total", {"ip_family": "IPv4"})
    assert total == deleted[4] > 0  # the total, not the total added up again
    assert sample("kpx_conntrack_delete_failures_total") == 2


def test_a_tcp_port_getting_endpoints_cleans_its_cluster_ip_entries_that_were_not_dnated() -> None:
    """A connection tried before the rule existed left an entry that was never DNATed; a new
    connection reusing its source port would follow it (stale_flows.py)."""
    state, _, proxier, flows = setup()
    state.upsert(SERVICES, service("a", "web"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    assert flows == []  # no endpoints: its connections are refused, nothing to clean
    state.upsert(SLICES, endpoint_slice("a", "web", "10.244.1.2"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    assert flows == [FlowFilter(4, 53, IP.of("10.96.0.10"), not_nated=True, proto=6)]
    flows.clear()
    state.upsert(SLICES, endpoint_slice("a", "web", "10.244.1.2", "10.244.2.2"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    assert flows == []  # it had endpoints: its entries were DNATed


def test_a_repair_cleans_every_ports_entries_that_were_not_dnated() -> None:
    """While a foreign change had removed rules, connections went on un-DNATed: after the
    full sync that repairs them, their entries go, for every port (which rules were missing
    is not known); a periodic full sync, which repairs nothing, cleans nothing."""
    state, _, _, flows = setup()
    backend = DriftingBackend()
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), DataplaneSettings())

    def record(filters: Iterable[FlowFilter]) -> int:
        flows.extend(filters)
        return 0

    proxier.delete_flows = record
    state.upsert(SERVICES, service("a", "web"))
    state.upsert(SLICES, endpoint_slice("a", "web", "10.244.1.2"))
    state.upsert(SERVICES, service("k", "dns", "UDP"))
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.1.3", proto="UDP"))
    proxier.sync()
    assert proxier.conntrack_cleaner.idle(10)
    flows.clear()
    backend.drift = "our ip table changed behind our back"
    proxier.repair(proxier.check_kernel())
    assert proxier.sync().full
    assert proxier.conntrack_cleaner.idle(10)
    vip = IP.of("10.96.0.10")
    assert sorted(flows) == [
        FlowFilter(4, 53, vip, not_nated=True, proto=6),
        FlowFilter(4, 53, vip, not_nated=True),  # UDP
    ]
    flows.clear()
    backend.drift = ""
    proxier.request_full_sync(f"{PERIODIC}: periodic full sync")
    assert proxier.sync().full
    assert proxier.conntrack_cleaner.idle(10)
    assert flows == []


# ---- Node changes cost what they change -----------------------------------------------------


def node(
    address: str = "10.242.0.1",
    zone: str = "zone-a",
    pod_cidr: str = "10.244.1.0/24",
    heartbeat: str = "2026-01-01T00:00:00Z",
    **labels: str,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": zone, **labels}},
        "spec": {"podCIDRs": [pod_cidr]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": address}],
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": heartbeat}],
        },
    }


def topology_service(ns: str, name: str) -> dict[str, Any]:
    svc = service(ns, name)
    svc["spec"]["trafficDistribution"] = "PreferClose"
    return svc


def zoned_slice(ns: str, svc: str) -> dict[str, Any]:
    """Two endpoints, one hinted for each zone."""
    sl = endpoint_slice(ns, svc, "10.244.1.2", "10.244.2.2")
    for ep, zone in zip(sl["endpoints"], ("zone-a", "zone-b"), strict=True):
        ep["hints"] = {"forZones": [{"name": zone}]}
    return sl


def count_recomputes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the Services the proxier recomputes, in order."""
    import kpx_agent.sync.proxier as proxier_mod

    seen: list[str] = []
    real = proxier_mod.service_model

    def counting(obj: Any, slices: Any, node_info: Any, external_ips: Any) -> Any:
        seen.append(obj["metadata"]["name"])
        return real(obj, slices, node_info, external_ips)

    monkeypatch.setattr(proxier_mod, "service_model", counting)
    return seen


def node_setup(
    monkeypatch: pytest.MonkeyPatch, detect: DetectLocal | None = None
) -> tuple[ClusterState, RecordingBackend, Proxier, list[str]]:
    state, backend, proxier, _ = setup()
    if detect is not None:
        proxier.settings = DataplaneSettings(detect_local=detect)
    state.upsert(NODES, node())
    for name in ("web", "api"):
        state.upsert(SERVICES, service("a", name))
        state.upsert(SLICES, endpoint_slice("a", name, "10.244.1.2"))
    state.upsert(SERVICES, topology_service("a", "near"))
    state.upsert(SLICES, zoned_slice("a", "near"))
    assert proxier.sync().full
    seen = count_recomputes(monkeypatch)
    backend.calls.clear()
    return state, backend, proxier, seen


def near_endpoints(proxier: Proxier) -> list[str]:
    [port] = [p for k, p in proxier.local.services.items() if k.name == "near"]
    return [str(e.ip) for e in port.cluster_endpoints]


def test_node_update_that_changes_no_input_costs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A status heartbeat, new conditions, another label: no recompute, no kernel work."""
    state, backend, proxier, seen = node_setup(monkeypatch)
    for i in range(5):
        state.upsert(NODES, node(heartbeat=f"2026-01-01T00:0{i}:00Z", team=f"t{i}"))
        assert state.has_changes()  # the sync loop wakes, and finds nothing to do
        outcome = proxier.sync()
        assert outcome.ok and not outcome.full and outcome.changed_ports == 0
    assert seen == [] and backend.calls == []
    registry = proxier.metrics.registry
    syncs = "kubeproxy_sync_proxy_rules_duration_seconds_count"
    assert registry.get_sample_value(syncs, {"ip_family": "IPv4"}) == 1  # heartbeats: no syncs


def test_zone_change_recomputes_only_topology_services_partially(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, backend, proxier, seen = node_setup(monkeypatch)
    assert near_endpoints(proxier) == ["10.244.1.2"]
    state.upsert(NODES, node(zone="zone-b"))
    outcome = proxier.sync()
    assert seen == ["near"]
    assert backend.calls == [({"a/near/tcp"}, False)]  # partial, that Service only
    assert not outcome.full and near_endpoints(proxier) == ["10.244.2.2"]
    assert proxier.local.node.zone == "zone-b"


def test_service_that_stops_using_topology_is_not_recomputed_for_the_zone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, backend, proxier, seen = node_setup(monkeypatch)
    state.upsert(SERVICES, service("a", "near"))  # trafficDistribution removed
    proxier.sync()
    seen.clear()
    backend.calls.clear()
    state.upsert(NODES, node(zone="zone-b"))
    proxier.sync()
    assert seen == [] and backend.calls == []


@pytest.mark.parametrize(
    ("changed", "detect"),
    [
        ({"address": "10.242.0.99"}, DetectLocalMode.CLUSTER_CIDR),
        ({"pod_cidr": "10.244.9.0/24"}, DetectLocalMode.NODE_CIDR),
    ],
    ids=str,
)
def test_address_or_pod_cidr_change_is_a_full_sync_without_recompute(
    monkeypatch: pytest.MonkeyPatch, changed: dict[str, str], detect: DetectLocalMode
) -> None:
    """A node change the backends render (its addresses are where NodePorts answer; its pod
    CIDR is the local-pod match in NodeCIDR mode) is a full sync."""
    state, backend, proxier, seen = node_setup(monkeypatch, DetectLocal(detect))
    state.upsert(NODES, node(**changed))
    outcome = proxier.sync()
    assert outcome.full and backend.calls[-1][1] is True
    assert seen == []  # no ServicePort depends on the node's addresses or pod CIDRs
    assert [str(a) for a in proxier.local.node.addresses] == [changed.get("address", "10.242.0.1")]
    assert [str(c) for c in proxier.local.node.pod_cidrs] == [
        changed.get("pod_cidr", "10.244.1.0/24")
    ]


def test_pod_cidr_change_costs_nothing_where_detect_local_does_not_use_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ClusterCIDR mode: the Node's pod CIDR is no node fact of any backend."""
    state, backend, proxier, seen = node_setup(monkeypatch)
    state.upsert(NODES, node(pod_cidr="10.244.9.0/24"))
    outcome = proxier.sync()
    assert outcome.ok and not outcome.full and backend.calls == [] and seen == []


def test_settings_change_is_a_full_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxier, not the backend, notices new settings (one place decides a full sync)."""
    state, backend, proxier, _ = node_setup(monkeypatch)
    proxier.settings = DataplaneSettings(masquerade_all=True)
    state.touch_all()
    assert proxier.sync().full and backend.calls[-1][1] is True
    assert not proxier.sync().full


def test_node_deleted_then_back_is_a_full_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    state, _, proxier, _ = node_setup(monkeypatch)
    state.delete(NODES, node())
    assert proxier.sync().full and proxier.local.node.addresses == ()
    state.upsert(NODES, node())
    assert proxier.sync().full


def test_unchanged_service_update_does_no_kernel_work() -> None:
    state, backend, proxier, _ = setup()
    state.upsert(SERVICES, service("a", "web"))
    proxier.sync()
    backend.calls.clear()
    annotated = service("a", "web")
    annotated["metadata"]["annotations"] = {"note": "no effect on the rules"}
    state.upsert(SERVICES, annotated)
    outcome = proxier.sync()
    assert outcome.ok and outcome.changed_ports == 0 and backend.calls == []


def test_queued_hook_runs_for_every_recorded_change() -> None:
    state, _, proxier, _ = setup()
    queued: list[int] = []
    state.on_queued = lambda: queued.append(1)
    state.upsert(SERVICES, service("a", "web"))
    state.upsert(SERVICES, service("a", "web"))  # the same object again: nothing recorded
    state.upsert(SERVICES, service("a", "api"))
    state.upsert(NODES, node())
    assert len(queued) == 3
    proxier.sync()
    state.touch_all()  # e.g. a failed sync's retry
    assert len(queued) == 4
    proxier.sync()
    state.upsert(NODES, node())  # the same Node again (a re-list): nothing recorded
    assert len(queued) == 4 and not state.has_changes()


class DriftingBackend(RecordingBackend):
    """A backend with a drift check (Backend.drifted): says what `drift` holds."""

    def __init__(self) -> None:
        super().__init__()
        self.drift = ""

    def drifted(self, reading: KernelReadBack | None = None) -> str:
        return self.drift


def test_drift_found_at_the_periodic_check_makes_the_next_sync_full() -> None:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    backend = DriftingBackend()
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), DataplaneSettings())
    state.upsert(SERVICES, service("a", "web"))
    proxier.sync()
    assert proxier.check_kernel() == []
    assert not state.has_changes()
    backend.drift = "our ip table changed behind our back"
    found = proxier.check_kernel()
    assert found == [KernelFinding(DRIFT, "our ip table changed behind our back")]
    proxier.repair(found)
    assert state.has_changes()
    assert proxier.metrics.forced_full_syncs.labels(DRIFT)._value.get() == 1
    assert proxier.sync().full and backend.calls[-1] == ({"a/web/tcp"}, True)


PERIODIC_SYNC = KernelFinding(PERIODIC, "periodic full sync")


def test_a_full_sync_is_forced_every_hour_with_jitter() -> None:
    _, _, proxier, _ = setup()
    now = [0.0]
    proxier.clock = lambda: now[0]
    proxier.rand = lambda: 0.5
    proxier.sync()
    assert proxier.check_kernel() == []  # the first check schedules it: 3600 s + 5% jitter
    now[0] = 3600.0 + 179.0
    assert proxier.check_kernel() == []
    now[0] = 3600.0 + 180.0
    assert proxier.check_kernel() == [PERIODIC_SYNC]
    proxier.repair([PERIODIC_SYNC])
    assert proxier.sync().full
    now[0] += 3779.0
    assert proxier.check_kernel() == []
    now[0] += 1.0
    assert proxier.check_kernel() == [PERIODIC_SYNC]


class FlushedMidSync(RecordingBackend):
    """A backend whose rules look gone while it rewrites them (a full sync's moment between
    tables): `programmed` says what `there` holds; `reading_during_sync` is read in a sync."""

    def __init__(self) -> None:
        super().__init__()
        self.there = True
        self.proxier: Proxier | None = None
        self.reading_during_sync: Any = None

    def programmed(self) -> bool:
        return self.there

    def sync(self, state: NodeLocalState, changed: Collection[ServicePortKey] | None) -> None:
        if self.proxier is not None and self.reading_during_sync is None:
            self.there = False
            self.reading_during_sync = self.proxier.read_kernel()
        super().sync(state, changed)
        self.there = True


def test_rules_found_gone_while_a_sync_ran_are_not_taken_for_gone() -> None:
    """The periodic check reads the kernel while syncs go on: rules that looked gone during
    a sync (begun before the read or after) may have been that sync's rewrite; only a
    reading no sync overlapped says they are gone."""
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    backend = FlushedMidSync()
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), DataplaneSettings())
    state.upsert(SERVICES, service("a", "web"))
    proxier.sync()
    backend.there = False
    reading = proxier.read_kernel()
    state.upsert(SERVICES, service("a", "db"))
    proxier.sync()  # overlaps the reading
    assert proxier.check_kernel(reading) == []
    backend.proxier = proxier
    state.upsert(SERVICES, service("a", "dns"))
    proxier.sync()  # the reading begins in it
    assert not backend.reading_during_sync.programmed
    assert proxier.check_kernel(backend.reading_during_sync) == []
    backend.there = False
    reading = proxier.read_kernel()
    assert proxier.check_kernel(reading) == [
        KernelFinding(GONE, "our rules are gone from the kernel")
    ]


def _triggered(slice_obj: dict[str, Any], at: float) -> dict[str, Any]:
    stamp = datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    slice_obj["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": stamp
    }
    return slice_obj


def programming_count(proxier: Proxier) -> float:
    """kubeproxy_network_programming_duration_seconds' IPv4 observations."""
    child = proxier.metrics.network_programming.labels("IPv4")
    return sum(b.get() for b in child._buckets)


def test_network_programming_latency_leaves_out_changes_made_before_the_agent_watched() -> None:
    """As upstream's tracker (trackerStartTime): a cold start lists every EndpointSlice, and
    their trigger times are of changes the agent never saw happen (hours or days old), so
    only those after the store began are observed; a deleted slice's trigger time (its last
    update's) is dropped."""
    state, _, proxier, _ = setup()
    state.started = time.time() - 60
    state.upsert(SERVICES, service("a", "old"))
    state.upsert(SLICES, _triggered(endpoint_slice("a", "old", "10.244.0.2"), time.time() - 3600))
    state.upsert(SERVICES, service("a", "new"))
    state.upsert(SLICES, _triggered(endpoint_slice("a", "new", "10.244.0.3"), time.time() - 5))
    proxier.sync()
    assert programming_count(proxier) == 1
    state.upsert(SLICES, _triggered(endpoint_slice("a", "old", "10.244.0.4"), time.time() - 1))
    state.delete(SLICES, endpoint_slice("a", "old", "10.244.0.4"))
    proxier.sync()
    assert programming_count(proxier) == 1


def test_a_slice_that_comes_before_its_service_is_counted_when_the_agent_takes_it() -> None:
    """Services and EndpointSlices come on separate watches: a slice may come first. The sync
    that takes it changes no rule (no Service yet) and programs nothing, but its trigger time
    is counted then (as upstream's sync counts every trigger time it takes), not dropped."""
    state, _, proxier, _ = setup()
    state.started = time.time() - 60
    assert proxier.sync().full  # the first sync
    state.upsert(SLICES, _triggered(endpoint_slice("a", "early", "10.244.0.2"), time.time() - 5))
    outcome = proxier.sync()
    assert not outcome.full and outcome.changed_ports == 0  # nothing programmed
    assert programming_count(proxier) == 1
    state.upsert(SERVICES, service("a", "early"))
    proxier.sync()
    assert programming_count(proxier) == 1  # once per trigger time
