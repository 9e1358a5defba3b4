"""The node-local model, one row per Service behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import ip_network
from typing import Any

import pytest

from kpx_agent.model.service_ports import is_proxied, node_info, service_model, service_ports
from kpx_agent.model.service_problems import SOURCE_RANGES_UNUSABLE
from kpx_agent.model.types import IP, NodeInfo, Protocol, ServicePort

NODE = NodeInfo(name="n1", zone="zone-a")


def svc(name: str = "web", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "clusterIP": "10.96.0.10",
        "clusterIPs": ["10.96.0.10"],
        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
    }
    base.update(spec)
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if "labels" in spec:
        meta["labels"] = base.pop("labels")
    if "annotations" in spec:
        meta["annotations"] = base.pop("annotations")
    status = base.pop("status", {})
    return {"metadata": meta, "spec": base, "status": status}


def ep(ip: str, node: str = "n2", **cond: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [ip], "nodeName": node}
    hints = cond.pop("hints", None)
    if hints is not None:
        out["hints"] = hints
    if cond:
        out["conditions"] = cond
    return out


def eps(*endpoints: dict[str, Any], family: str = "IPv4", port: int = 8080, name: str = "http"):
    return {
        "metadata": {"name": "web-x", "namespace": "default"},
        "addressType": family,
        "ports": [{"name": name, "port": port, "protocol": "TCP"}],
        "endpoints": list(endpoints),
    }


def ips(port: ServicePort, which: str = "cluster") -> list[str]:
    chosen = port.cluster_endpoints if which == "cluster" else port.external_endpoints
    return [str(e.ip) for e in chosen]


@dataclass
class Row:
    name: str
    service: dict[str, Any]
    slices: list[dict[str, Any]] = field(default_factory=list)
    cluster: list[str] | None = None
    external: list[str] | None = None
    check: Any = None  # extra assertion on the first port


ROWS = [
    Row(
        "ready endpoints are used",
        svc(),
        [eps(ep("10.244.1.2"), ep("10.244.2.2"))],
        cluster=["10.244.1.2", "10.244.2.2"],
    ),
    Row("ready unset means ready", svc(), [eps(ep("10.244.1.2"))], cluster=["10.244.1.2"]),
    Row(
        "not-ready endpoints are left out",
        svc(),
        [eps(ep("10.244.1.2", ready=False), ep("10.244.2.2", ready=True))],
        cluster=["10.244.2.2"],
    ),
    Row(
        "no ready endpoint: serving-and-terminating ones are used",
        svc(),
        [
            eps(
                ep("10.244.1.2", ready=False, serving=True, terminating=True),
                ep("10.244.2.2", ready=False, serving=False, terminating=True),
            )
        ],
        cluster=["10.244.1.2"],
    ),
    Row(
        "terminating endpoints are not used while one is ready",
        svc(),
        [eps(ep("10.244.1.2", ready=False, serving=True, terminating=True), ep("10.244.2.2"))],
        cluster=["10.244.2.2"],
    ),
    Row("no endpoints at all", svc(), [], cluster=[]),
    Row(
        "endpoints of several slices merge and de-duplicate",
        svc(),
        [eps(ep("10.244.1.2")), eps(ep("10.244.1.2"), ep("10.244.3.2"))],
        cluster=["10.244.1.2", "10.244.3.2"],
    ),
    Row(
        "a slice without the port name gives no endpoints",
        svc(),
        [eps(ep("10.244.1.2"), name="other")],
        cluster=[],
    ),
    Row(
        "invalid endpoint addresses are skipped",
        svc(),
        [eps(ep("not-an-ip"), ep("10.244.1.2"))],
        cluster=["10.244.1.2"],
    ),
    Row(
        "addresses that are not strings, or of the other family, are skipped",
        svc(),
        [eps(ep({"ip": "x"}), ep(7), ep("fd00::1"), ep("010.244.1.3"), ep("10.244.1.2"))],  # type: ignore[arg-type]
        cluster=["10.244.1.2"],
    ),
    Row(
        "an IPv6 address written two ways is one endpoint",
        svc(clusterIP="fd00:96::1", clusterIPs=["fd00:96::1"]),
        [eps(ep("fd00:244::0001"), ep("fd00:244::1"), family="IPv6")],
        check=lambda p: [e.ip for e in p.cluster_endpoints] == ["fd00:244::1"],
    ),
    Row(
        "target port comes from the slice",
        svc(),
        [eps(ep("10.244.1.2"), port=9999)],
        check=lambda p: p.cluster_endpoints[0].port == 9999,
    ),
    Row(
        "endpoints on this node are local",
        svc(),
        [eps(ep("10.244.1.2", node="n1"))],
        check=lambda p: p.cluster_endpoints[0].local,
    ),
    Row(
        "ClusterIP services have no NodePort",
        svc(ports=[{"port": 80, "nodePort": 30080}]),
        check=lambda p: p.node_port == 0,
    ),
    Row(
        "NodePort services keep their node port",
        svc(type="NodePort", ports=[{"port": 80, "nodePort": 30080}]),
        check=lambda p: p.node_port == 30080 and p.external_masquerade,
    ),
    Row(
        "externalIPs are external addresses",
        svc(externalIPs=["192.0.2.10"]),
        check=lambda p: [str(i) for i in p.external_ips] == ["192.0.2.10"],
    ),
    Row(
        "LoadBalancer ingress IPs are used",
        svc(type="LoadBalancer", status={"loadBalancer": {"ingress": [{"ip": "192.0.2.20"}]}}),
        check=lambda p: [str(i) for i in p.load_balancer_ips] == ["192.0.2.20"],
    ),
    Row(
        "LoadBalancer ingress with ipMode Proxy is not programmed",
        svc(
            type="LoadBalancer",
            status={"loadBalancer": {"ingress": [{"ip": "192.0.2.20", "ipMode": "Proxy"}]}},
        ),
        check=lambda p: p.load_balancer_ips == (),
    ),
    Row(
        "loadBalancerSourceRanges are parsed",
        svc(type="LoadBalancer", loadBalancerSourceRanges=["198.51.100.0/24", "bogus"]),
        check=lambda p: p.load_balancer_source_ranges == (ip_network("198.51.100.0/24"),),
    ),
    Row(
        "externalTrafficPolicy Local: external traffic only to local endpoints",
        svc(
            type="NodePort",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000,
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        [eps(ep("10.244.1.2", node="n1"), ep("10.244.2.2", node="n2"))],
        cluster=["10.244.1.2", "10.244.2.2"],
        external=["10.244.1.2"],
        check=lambda p: (
            not p.external_masquerade
            and p.drop_when_no_external_endpoints
            and p.health_check_node_port == 32000
            # the short circuit (local pods, the node itself): every cluster endpoint
            and [e.ip for e in p.short_circuit_endpoints] == ["10.244.1.2", "10.244.2.2"]
        ),
    ),
    Row(
        "externalTrafficPolicy Local with both policies Local: the short circuit ignores ITP",
        svc(
            type="NodePort",
            externalTrafficPolicy="Local",
            internalTrafficPolicy="Local",
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        [eps(ep("10.244.2.2", node="n2"))],
        cluster=[],
        external=[],
        check=lambda p: (
            p.drop_when_no_external_endpoints
            and [e.ip for e in p.short_circuit_endpoints] == ["10.244.2.2"]
        ),
    ),
    Row(
        "externalTrafficPolicy Local without any endpoint: rejected, not dropped (as upstream)",
        svc(
            type="NodePort",
            externalTrafficPolicy="Local",
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        [eps(ep("10.244.2.2", node="n2", ready=False))],
        cluster=[],
        external=[],
        check=lambda p: not p.drop_when_no_external_endpoints and not p.short_circuit_endpoints,
    ),
    Row(
        "externalTrafficPolicy Local is ignored for ClusterIP services",
        svc(externalTrafficPolicy="Local", externalIPs=["192.0.2.10"]),
        [eps(ep("10.244.2.2", node="n2"))],
        external=["10.244.2.2"],
        check=lambda p: p.external_masquerade and not p.short_circuit_endpoints,
    ),
    Row(
        "internalTrafficPolicy Local: only local endpoints, drop when none",
        svc(internalTrafficPolicy="Local"),
        [eps(ep("10.244.2.2", node="n2"))],
        cluster=[],
        external=["10.244.2.2"],
        check=lambda p: p.drop_when_no_cluster_endpoints,
    ),
    Row(
        "internalTrafficPolicy Local without any endpoint: rejected, not dropped (as upstream)",
        svc(internalTrafficPolicy="Local"),
        [eps(ep("10.244.2.2", node="n2", ready=False))],
        cluster=[],
        external=[],
        check=lambda p: not p.drop_when_no_cluster_endpoints,
    ),
    Row(
        "sessionAffinity ClientIP defaults to 10800 s",
        svc(sessionAffinity="ClientIP"),
        check=lambda p: p.affinity_timeout == 10800,
    ),
    Row(
        "sessionAffinity ClientIP with a timeout",
        svc(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
        check=lambda p: p.affinity_timeout == 60,
    ),
    Row("no affinity by default", svc(), check=lambda p: p.affinity_timeout == 0),
    Row(
        "topology: zone hints used when the Service asks",
        svc(trafficDistribution="PreferClose"),
        [
            eps(
                ep("10.244.1.2", hints={"forZones": [{"name": "zone-a"}]}),
                ep("10.244.2.2", hints={"forZones": [{"name": "zone-b"}]}),
            )
        ],
        cluster=["10.244.1.2"],
    ),
    Row(
        "topology: hints ignored unless the Service asks",
        svc(),
        [
            eps(
                ep("10.244.1.2", hints={"forZones": [{"name": "zone-a"}]}),
                ep("10.244.2.2", hints={"forZones": [{"name": "zone-b"}]}),
            )
        ],
        cluster=["10.244.1.2", "10.244.2.2"],
    ),
    Row(
        "topology: an endpoint without hints disables them",
        svc(annotations={"service.kubernetes.io/topology-mode": "Auto"}),
        [eps(ep("10.244.1.2", hints={"forZones": [{"name": "zone-a"}]}), ep("10.244.2.2"))],
        cluster=["10.244.1.2", "10.244.2.2"],
    ),
    Row(
        "topology: no hint for this zone falls back to all",
        svc(trafficDistribution="PreferClose"),
        [eps(ep("10.244.1.2", hints={"forZones": [{"name": "zone-b"}]}))],
        cluster=["10.244.1.2"],
    ),
    Row(
        "topology: PreferSameNode node hints win",
        svc(trafficDistribution="PreferSameNode"),
        [
            eps(
                ep(
                    "10.244.1.2",
                    node="n1",
                    hints={"forNodes": [{"name": "n1"}], "forZones": [{"name": "zone-a"}]},
                ),
                ep(
                    "10.244.1.3",
                    node="n3",
                    hints={"forNodes": [{"name": "n3"}], "forZones": [{"name": "zone-a"}]},
                ),
            )
        ],
        cluster=["10.244.1.2"],
    ),
    Row(
        "topology does not apply to externalTrafficPolicy Local",
        svc(
            type="NodePort",
            externalTrafficPolicy="Local",
            trafficDistribution="PreferClose",
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        [
            eps(
                ep("10.244.1.2", node="n1", hints={"forZones": [{"name": "zone-b"}]}),
                ep("10.244.2.2", node="n2", hints={"forZones": [{"name": "zone-a"}]}),
            )
        ],
        cluster=["10.244.2.2"],
        external=["10.244.1.2"],
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_service_behaviour(row: Row) -> None:
    ports = service_ports(row.service, row.slices, NODE)
    assert ports, "the service produced no ports"
    port = ports[0]
    if row.cluster is not None:
        assert ips(port) == row.cluster
    if row.external is not None:
        assert ips(port, "external") == row.external
    if row.check is not None:
        assert row.check(port)


@pytest.mark.parametrize(
    "service",
    [
        svc(clusterIP="None", clusterIPs=["None"]),
        svc(type="ExternalName", clusterIP="", clusterIPs=[]),
        svc(labels={"service.kubernetes.io/service-proxy-name": "other"}),
    ],
    ids=["headless", "ExternalName", "service-proxy-name"],
)
def test_services_this_agent_ignores(service: dict[str, Any]) -> None:
    assert not is_proxied(service)
    assert service_ports(service, [eps(ep("10.244.1.2"))], NODE) == []


def test_multi_port_service_maps_ports_by_name() -> None:
    service = svc(
        ports=[
            {"name": "http", "port": 80, "protocol": "TCP"},
            {"name": "dns", "port": 53, "protocol": "UDP"},
        ]
    )
    slice_ = {
        "metadata": {"name": "s", "namespace": "default"},
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 5353, "protocol": "UDP"},
        ],
        "endpoints": [ep("10.244.1.2")],
    }
    by_name = {p.key.port_name: p for p in service_ports(service, [slice_], NODE)}
    assert by_name["http"].key.protocol is Protocol.TCP
    assert by_name["http"].cluster_endpoints[0].port == 8080
    assert by_name["dns"].key.protocol is Protocol.UDP
    assert by_name["dns"].cluster_endpoints[0].port == 5353


def test_invalid_ports_and_protocols_are_skipped() -> None:
    service = svc(
        ports=[
            {"name": "a", "port": 0},
            {"name": "b", "port": 70000},
            {"name": "c", "port": 80, "protocol": "ICMP"},
            {"name": "d", "port": 81},
        ]
    )
    assert [p.key.port_name for p in service_ports(service, [], NODE)] == ["d"]


def test_dual_stack_gives_one_port_per_family() -> None:
    service = svc(clusterIPs=["10.96.0.10", "fd00:96::10"])
    slices = [
        eps(ep("10.244.1.2")),
        eps(ep("fd00:244:1::2"), family="IPv6"),
    ]
    ports = {p.key.family: p for p in service_ports(service, slices, NODE)}
    assert set(ports) == {4, 6}
    assert ips(ports[4]) == ["10.244.1.2"]
    assert ips(ports[6]) == ["fd00:244:1::2"]
    assert [str(i) for i in ports[6].cluster_ips] == ["fd00:96::10"]


def test_node_info_reads_addresses_zone_and_pod_cidrs() -> None:
    node = {
        "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "zone-a"}},
        "spec": {"podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]},
        "status": {
            "addresses": [
                {"type": "Hostname", "address": "n1"},
                {"type": "ExternalIP", "address": "192.0.2.1"},
                {"type": "InternalIP", "address": "10.242.0.1"},
                {"type": "InternalIP", "address": "bogus"},
            ]
        },
    }
    info = node_info(node, "n1")
    assert info.addresses == (IP.of("10.242.0.1"), IP.of("192.0.2.1"))
    assert info.zone == "zone-a"
    assert [str(c) for c in info.pod_cidrs] == ["10.244.1.0/24", "fd00:244:1::/64"]
    assert node_info(None, "n1") == NodeInfo(name="n1")


LB = {"type": "LoadBalancer", "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.21"}]}}}
LB_DUAL = {
    "type": "LoadBalancer",
    "clusterIPs": ["10.96.0.10", "fd00:96::10"],
    "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.21"}, {"ip": "2001:db8::21"}]}},
}


@pytest.mark.parametrize(
    ("ranges", "want"),
    [
        (["010.0.0.0/8"], ["10.0.0.0/8"]),
        (["::ffff:10.0.0.0/104"], ["10.0.0.0/8"]),
        ([" 10.0.0.0/8 ", "bogus"], ["10.0.0.0/8"]),
    ],
)
def test_source_ranges_read_as_kubernetes_does(ranges: list[str], want: list[str]) -> None:
    model = service_model(svc(loadBalancerSourceRanges=ranges, **LB), [], NODE)
    (port,) = model.ports
    assert port.load_balancer_source_ranges == tuple(ip_network(w) for w in want)
    assert not port.load_balancer_closed and port.load_balancer_firewall
    assert model.problems == ()


def test_source_ranges_none_usable_close_the_load_balancer() -> None:
    model = service_model(svc(loadBalancerSourceRanges=["bogus", "10.0.0.0/40"], **LB), [], NODE)
    (port,) = model.ports
    assert port.load_balancer_closed and port.load_balancer_firewall
    assert port.load_balancer_source_ranges == ()
    (problem,) = model.problems
    assert problem.reason == SOURCE_RANGES_UNUSABLE
    assert "'bogus'" in problem.message and "192.0.2.21" in problem.message


def test_source_ranges_of_one_family_close_the_other() -> None:
    model = service_model(svc(loadBalancerSourceRanges=["10.0.0.0/8"], **LB_DUAL), [], NODE)
    ports = {p.key.family: p for p in model.ports}
    assert not ports[4].load_balancer_closed
    assert ports[6].load_balancer_closed and ports[6].load_balancer_source_ranges == ()
    (problem,) = model.problems
    assert "IPv6" in problem.message and "2001:db8::21" in problem.message


def test_no_source_ranges_leave_the_load_balancer_open() -> None:
    model = service_model(svc(**LB_DUAL), [], NODE)
    assert not any(p.load_balancer_firewall for p in model.ports)
    assert model.problems == ()
