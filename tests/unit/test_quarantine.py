"""A Service over the cost cap is quarantined in that family, reported, and programmed again once
it is back under it; the others are programmed all along (issue #22, "bounded memory")."""

from __future__ import annotations

from test_proxier import endpoint_slice, service, setup

from kpx_agent.model.quarantine import MAX_SERVICE_COST, cost, quarantine
from kpx_agent.model.service_problems import QUARANTINED
from kpx_agent.model.types import IP, Endpoint, Protocol, ServicePort, ServicePortKey
from kpx_agent.store.cluster_state import SERVICES, SLICES


def port(name: str, family: int, endpoints: int) -> ServicePort:
    base = "10.244.0." if family == 4 else "fd00::"
    eps = tuple(Endpoint(IP.of(f"{base}{i + 1}"), 8080) for i in range(endpoints))
    return ServicePort(
        ServicePortKey("ns", "big", name, Protocol.TCP, family),
        80,
        cluster_endpoints=eps,
        external_endpoints=eps,
    )


def test_cost_is_endpoints_per_port_added_up_per_family() -> None:
    assert cost(port("a", 4, 7)) == 7  # the same endpoints on both paths count once
    ports = [port("a", 4, 6), port("b", 4, 5), port("a", 6, 3)]
    kept, problems = quarantine("ns", "big", ports, cap=10)
    assert [(p.key.name, p.family) for p in kept] == [("big", 6)]  # IPv6 (3) is under it
    (problem,) = problems
    assert problem.reason == QUARANTINED and problem.service == ("ns", "big")
    assert "IPv4" in problem.message and "11 endpoints" in problem.message
    assert quarantine("ns", "big", ports, cap=11) == (ports, ())
    assert MAX_SERVICE_COST == 100_000  # the documented cap (docs/api.md)


def test_a_quarantined_service_is_left_out_and_back_when_under_the_cap() -> None:
    state, _, proxier, _ = setup()
    proxier.max_service_cost = 3
    state.upsert(SERVICES, service("k", "small"))
    state.upsert(SLICES, endpoint_slice("k", "small", "10.244.1.2"))
    big = {**service("k", "big"), "spec": {"clusterIPs": ["10.96.0.11"], "ports": [{"port": 53}]}}
    state.upsert(SERVICES, big)
    state.upsert(SLICES, endpoint_slice("k", "big", *(f"10.244.2.{i}" for i in range(1, 5))))
    assert proxier.sync().ok
    assert {k.name for k in proxier.local.services} == {"small"}
    assert [p.reason for p in proxier.problems.current()] == [QUARANTINED]
    state.upsert(SLICES, endpoint_slice("k", "big", "10.244.2.1", "10.244.2.2"))
    assert proxier.sync().ok
    assert {k.name for k in proxier.local.services} == {"small", "big"}
    assert proxier.problems.current() == frozenset()
