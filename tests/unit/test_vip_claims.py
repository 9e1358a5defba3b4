"""VIP clashes (CVE-2020-8554 class): decided by the model alike whatever order the Services
come in, the loser's clashing address left out and reported, and every backend rendering the
decision (the victim's VIP goes to the victim's endpoints)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from semantics import TCP, WORLD, Outcome, Packet

from kpx_agent.backends.base import Backend
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.fake import FakeIptables
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.fake import FakeNftables
from kpx_agent.model.service_problems import VIP_CLASH
from kpx_agent.model.types import IP, DataplaneSettings, Protocol, ServicePort, ServicePortKey
from kpx_agent.model.vip_claims import VipClaims, creation_time
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.sync.proxier import MODEL_PROBLEMS, Proxier
from kpx_api.proxysettings import NamespaceOptOut

VICTIM_VIP = "10.96.0.10"


def service(
    ns: str,
    name: str,
    cluster_ip: str,
    created: str = "2026-01-01T00:00:00Z",
    port: int = 80,
    external_ips: tuple[str, ...] = (),
    lb_ip: str = "",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "clusterIPs": [cluster_ip],
        "ports": [{"port": port, "protocol": "TCP"}],
        "externalIPs": list(external_ips),
    }
    status: dict[str, Any] = {}
    if lb_ip:
        spec["type"] = "LoadBalancer"
        status = {"loadBalancer": {"ingress": [{"ip": lb_ip}]}}
    meta = {"namespace": ns, "name": name, "creationTimestamp": created}
    return {"metadata": meta, "spec": spec, "status": status}


def endpoints(ns: str, svc: str, ip: str) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": ns,
            "name": f"{svc}-1",
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "nodeName": "n2"}],
    }


class NullBackend(Backend):
    mode = "test"

    def __init__(self) -> None:
        self.settings = DataplaneSettings()

    def sync(self, state: object, changed: object) -> None:
        pass

    def cleanup(self) -> None:
        pass

    def reconfigure(self, settings: DataplaneSettings) -> None:
        self.settings = settings


def proxier_with(backend: Backend) -> tuple[ClusterState, Proxier]:
    state = ClusterState()
    for kind in (SERVICES, SLICES, NAMESPACES, NODES):
        state.replace(kind, [])
    settings = backend.settings  # type: ignore[attr-defined]  # each test backend's own
    proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), settings)
    proxier.delete_flows = lambda flows: 0
    return state, proxier


VICTIM = service("z", "victim", VICTIM_VIP, created="2026-03-01T00:00:00Z")
# Older than the victim, and sorting first: neither may win against a ClusterIP.
BY_LB = service("a", "by-lb", "10.96.0.20", created="2025-01-01T00:00:00Z", lb_ip=VICTIM_VIP)
BY_EXTERNAL = service(
    "a", "by-external", "10.96.0.30", created="2025-01-01T00:00:00Z", external_ips=(VICTIM_VIP,)
)


def key(ns: str, name: str) -> ServicePortKey:
    return ServicePortKey(ns, name, "", Protocol.TCP, 4)


def programmed(proxier: Proxier) -> dict[str, tuple[list[str], list[str], list[str]]]:
    return {
        f"{k.namespace}/{k.name}": (
            list(p.cluster_ips),
            list(p.load_balancer_ips),
            list(p.external_ips),
        )
        for k, p in proxier.local.services.items()
    }


EXPECTED = {
    "z/victim": ([VICTIM_VIP], [], []),
    "a/by-lb": (["10.96.0.20"], [], []),
    "a/by-external": (["10.96.0.30"], [], []),
}


@pytest.mark.parametrize("one_by_one", [False, True], ids=["together", "one-by-one"])
@pytest.mark.parametrize(
    "order", list(itertools.permutations(range(3))), ids=lambda o: "".join(map(str, o))
)
def test_a_clusterip_wins_over_lb_and_external_ips_in_any_order(
    order: tuple[int, ...], one_by_one: bool
) -> None:
    state, proxier = proxier_with(NullBackend())
    for i in order:
        state.upsert(SERVICES, (VICTIM, BY_LB, BY_EXTERNAL)[i])
        if one_by_one:
            proxier.sync()
    proxier.sync()
    assert programmed(proxier) == EXPECTED
    problems = proxier.problems.of(MODEL_PROBLEMS)
    assert {(p.namespace, p.name, p.reason) for p in problems} == {
        ("a", "by-lb", VIP_CLASH),
        ("a", "by-external", VIP_CLASH),
    }
    assert all(f"{VICTIM_VIP}:80/tcp" in p.message and "z/victim" in p.message for p in problems)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_between_equals_the_older_service_then_the_name_wins(order: tuple[int, ...]) -> None:
    old = service(
        "b", "old", "10.96.0.1", created="2025-06-01T00:00:00Z", external_ips=("192.0.2.1",)
    )
    new_a = service(
        "a",
        "new-a",
        "10.96.0.2",
        created="2026-06-01T00:00:00Z",
        external_ips=("192.0.2.1", "192.0.2.2"),
    )
    new_b = service(
        "a", "new-b", "10.96.0.3", created="2026-06-01T00:00:00Z", external_ips=("192.0.2.2",)
    )
    state, proxier = proxier_with(NullBackend())
    for i in order:
        state.upsert(SERVICES, (old, new_a, new_b)[i])
        proxier.sync()
    got = programmed(proxier)
    assert got["b/old"][2] == ["192.0.2.1"]
    assert got["a/new-a"][2] == ["192.0.2.2"]  # loses .1 to the older; wins .2 by name
    assert got["a/new-b"][2] == []


def test_only_the_clashing_port_is_left_out() -> None:
    other_port = service("a", "by-external", "10.96.0.30", port=443, external_ips=(VICTIM_VIP,))
    state, proxier = proxier_with(NullBackend())
    state.upsert(SERVICES, VICTIM)
    state.upsert(SERVICES, other_port)
    proxier.sync()
    assert programmed(proxier)["a/by-external"] == (["10.96.0.30"], [], [VICTIM_VIP])
    assert not proxier.problems.current()


def test_the_loser_takes_the_vip_when_the_winner_goes_in_a_partial_sync() -> None:
    state, proxier = proxier_with(NullBackend())
    state.upsert(SERVICES, VICTIM)
    state.upsert(SERVICES, BY_EXTERNAL)
    proxier.sync()
    assert programmed(proxier)["a/by-external"][2] == []
    state.delete(SERVICES, VICTIM)
    outcome = proxier.sync()
    assert not outcome.full
    assert programmed(proxier) == {"a/by-external": (["10.96.0.30"], [], [VICTIM_VIP])}
    assert not proxier.problems.current()
    # And gives it back when the ClusterIP comes again.
    state.upsert(SERVICES, VICTIM)
    proxier.sync()
    assert programmed(proxier)["a/by-external"][2] == []
    assert len(proxier.problems.current()) == 1


def test_an_uncontested_port_touches_no_other_claimant() -> None:
    claims = VipClaims()
    a = ServicePort(key("a", "a"), 80, cluster_ips=(IP.of("10.96.0.1"),))
    b = ServicePort(key("b", "b"), 80, cluster_ips=(IP.of("10.96.0.2"),))
    assert claims.update(a.key, a) == {a.key}
    assert claims.update(b.key, b) == {b.key}
    clash = ServicePort(key("c", "c"), 80, external_ips=(IP.of("10.96.0.1"),))
    assert claims.update(clash.key, clash) == {a.key, clash.key}
    assert claims.update(clash.key, None) == {a.key, clash.key}
    assert claims.update(b.key, None) == {b.key}


def test_creation_time_unknown_counts_as_newest() -> None:
    assert creation_time("2026-01-01T00:00:00Z") < creation_time(None)
    assert creation_time("not a time") == creation_time("")


# The backends render the decision: a packet to the victim's ClusterIP reaches the victim's
# endpoint, whichever Service the agent saw first (claimant first: a partial sync adds the
# victim; claimant named to sort first: iptables' rule order).
VICTIM_EP, CLAIMANT_EP = "10.244.2.2", "10.244.2.7"


def to_victim() -> Packet:
    return Packet(
        4,
        WORLD.client,
        VICTIM_VIP,
        TCP,
        80,
        "pod",
        WORLD.bridge,
        frozenset({WORLD.node, "127.0.0.1"}),
    )


def nft() -> tuple[Backend, Any]:
    fake = FakeNftables()
    backend = NftablesBackend(DataplaneSettings(), fake)
    return backend, fake


def ipt() -> tuple[Backend, Any]:
    fake = FakeIptables()
    backend = IptablesBackend(
        DataplaneSettings(),
        fake,
        ensure_sysctl=lambda path, value: None,
    )
    return backend, fake


@pytest.mark.parametrize("claimant", [BY_EXTERNAL, BY_LB], ids=["external-ip", "lb-ingress"])
@pytest.mark.parametrize("make", [nft, ipt], ids=["nftables", "iptables"])
@pytest.mark.parametrize("partial", [True, False], ids=["claimant-first", "full"])
def test_the_victims_vip_goes_to_the_victim(make: Any, claimant: Any, partial: bool) -> None:
    backend, fake = make()
    state, proxier = proxier_with(backend)
    claimant_name = claimant["metadata"]["name"]
    state.upsert(SERVICES, claimant)
    state.upsert(SLICES, endpoints("a", claimant_name, CLAIMANT_EP))
    if partial:
        assert proxier.sync().ok
    state.upsert(SERVICES, VICTIM)
    state.upsert(SLICES, endpoints("z", "victim", VICTIM_EP))
    assert proxier.sync().ok
    assert fake.trace(to_victim()) == {Outcome("accept", (VICTIM_EP, 8080), False)}


def test_the_claims_decide_alike_in_every_order_of_updates() -> None:
    """The index alone, fed in every order (no set order involved): the same winners."""
    vip = IP.of(VICTIM_VIP)
    ports = [
        ServicePort(key("z", "victim"), 80, cluster_ips=(vip,)),
        ServicePort(key("a", "lb"), 80, load_balancer_ips=(vip,)),
        ServicePort(key("a", "ext-old"), 80, external_ips=(vip, IP.of("192.0.2.1"))),
        ServicePort(key("a", "ext-new"), 80, external_ips=(IP.of("192.0.2.1"),)),
    ]
    created = {"victim": 3.0, "lb": 1.0, "ext-old": 1.0, "ext-new": 2.0}
    results = set()
    for order in itertools.permutations(ports):
        claims = VipClaims()
        for port in order:
            claims.update(port.key, port, created[port.key.name])
        resolved = tuple(claims.resolve(p)[0] for p in ports)
        results.add(resolved)
    (only,) = results
    assert [p.cluster_ips + p.load_balancer_ips + p.external_ips for p in only] == [
        (vip,),
        (),
        (IP.of("192.0.2.1"),),
        (),
    ]
