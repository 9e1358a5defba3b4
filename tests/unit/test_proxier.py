"""One sync, with a recording backend: what is recomputed, what the backend is told, and what
happens on failure."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from kpx_agent.backends.base import BackendError
from kpx_agent.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.conntrack import FlowFilter
from kpx_agent.localnet import NodeLocalState, ProxySettings, ServicePortKey
from kpx_agent.metrics import AgentMetrics
from kpx_agent.proxier import Proxier
from kpx_api.proxysettings import NamespaceOptOut


class RecordingBackend:
    mode = "test"

    def __init__(self) -> None:
        self.settings = ProxySettings()
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


def service(ns: str, name: str, proto: str = "TCP") -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name},
        "spec": {"clusterIPs": ["10.96.0.10"], "ports": [{"port": 53, "protocol": proto}]},
    }


def endpoint_slice(ns: str, svc: str, *ips: str, proto: str = "TCP") -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": f"{svc}-1",
                     "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": [{"port": 5353, "protocol": proto}],
        "endpoints": [{"addresses": [ip]} for ip in ips],
    }  # fmt: skip


def setup() -> tuple[ClusterState, RecordingBackend, Proxier, list[FlowFilter]]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    backend = RecordingBackend()
    flows: list[FlowFilter] = []

    def record(filters: Iterable[FlowFilter]) -> int:
        flows.extend(filters)
        return 0

    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics())
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
    state.upsert(SLICES, endpoint_slice("a", "web", "10.244.1.2"))
    outcome = proxier.sync()
    assert not outcome.ok and proxier.metrics.sync_failures._value.get() == 1
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
    flows.clear()  # 0 -> 2 endpoints cleaned the VIP's entries; not what this test is about
    state.upsert(SLICES, endpoint_slice("k", "dns", "10.244.2.2", proto="UDP"))
    proxier.sync()
    assert [str(f.dnat_to) for f in flows] == ["10.244.1.2"]
