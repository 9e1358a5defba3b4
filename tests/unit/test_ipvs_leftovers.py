"""backends/ipvs/leftovers.py: another kpx mode's agent removes only the IPVS state a kpx ipvs agent
made; upstream kube-proxy's virtual servers and kube-ipvs0 (and anyone else's) stay, for the
takeover path."""

from __future__ import annotations

import json
from ipaddress import ip_network

from kpx_agent.backends.ipvs.leftovers import KpxMarks, draining, parse_marks, plan_cleanup
from kpx_agent.backends.ipvs.model import VirtualKey, plan_port
from kpx_agent.handover.kube_proxy_leftovers import ipvs_mode_chains
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    Endpoint,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortKey,
)

NODE = NodeInfo("n1", (IP.of("192.168.1.10"),))
SETTINGS = DataplaneSettings()
EP = Endpoint(IP.of("10.244.1.5"), 8080, True)


def port(name: str, **fields: object) -> ServicePort:
    return ServicePort(ServicePortKey("d", name, "", Protocol.TCP, 4), 80, **fields)  # type: ignore[arg-type]


# What a kpx ipvs agent programs for: a ClusterIP, a NodePort (ETP Cluster), a NodePort and a
# load-balancer IP with externalTrafficPolicy Local and a local endpoint (not masqueraded: no
# helper set names them), and a Service without endpoints.
PORTS = [
    port(
        "web",
        cluster_ips=(IP.of("10.96.0.10"),),
        cluster_endpoints=(EP,),
        external_endpoints=(EP,),
        node_port=30080,
    ),
    port(
        "local",
        cluster_ips=(IP.of("10.96.0.11"),),
        cluster_endpoints=(EP,),
        external_endpoints=(EP,),
        node_port=30081,
        external_masquerade=False,
        load_balancer_ips=(IP.of("203.0.113.7"),),
    ),
    port("none", cluster_ips=(IP.of("10.96.0.12"),)),
]
PLANS = [plan_port(p, NODE, SETTINGS) for p in PORTS]


def kpx_node() -> tuple[KpxMarks, dict[VirtualKey, list[tuple[str, int]]], set[tuple[int, str]]]:
    """The marks, virtual servers and kube-ipvs0 addresses the plans above leave on a node."""
    servers: set[tuple[int, str, str, int]] = set()
    endpoints: set[tuple[str, str, int]] = set()
    vss: dict[VirtualKey, list[tuple[str, int]]] = {}
    bound: set[tuple[int, str]] = set()
    for plan in PLANS:
        for name, members in plan.elements.items():
            for family, address, protocol, p, *_ in members:
                if name == "hairpin":
                    endpoints.add((str(address), str(protocol), int(str(p))))
                else:
                    servers.add((int(str(family)), str(protocol), str(address), int(str(p))))
        vss.update({k: sorted(v.real_servers) for k, v in plan.virtual_servers.items()})
        bound |= plan.bound
    return KpxMarks(frozenset({4}), frozenset(servers), frozenset(endpoints)), vss, bound


FOREIGN = {
    VirtualKey(4, "tcp", "192.168.60.1", 80): [("192.168.60.20", 80)],  # someone's LB
    VirtualKey(4, "udp", "192.168.1.10", 514): [],  # on a node address, no real server
}


def test_every_virtual_server_a_kpx_ipvs_agent_made_is_its_own_and_no_other() -> None:
    marks, vss, bound = kpx_node()
    assert VirtualKey(4, "tcp", "192.168.1.10", 30081) in vss  # the ETP Local NodePort
    plan = plan_cleanup(marks, False, {**vss, **FOREIGN}, bound)
    assert set(plan.virtual_servers) == set(vss)
    assert plan.dummy and plan.tables == (4,)


def test_without_kpxs_helper_table_nothing_of_ipvs_is_touched() -> None:
    # Upstream kube-proxy's ipvs mode: the same virtual servers on the same kube-ipvs0, but no
    # kpx-ipvs table. They go only through the takeover (handover/from_kube_proxy.py).
    _marks, vss, bound = kpx_node()
    plan = plan_cleanup(KpxMarks(), False, {**vss, **FOREIGN}, bound)
    assert plan.virtual_servers == () and not plan.dummy and plan.tables == ()


def test_with_kube_proxys_ipvs_chains_only_kpxs_tables_go() -> None:
    marks, vss, bound = kpx_node()
    plan = plan_cleanup(marks, True, vss, bound)
    assert plan.virtual_servers == () and not plan.dummy and plan.tables == (4,)
    assert "takeover" in plan.why


def test_exclude_cidrs_are_left_alone() -> None:
    marks, vss, bound = kpx_node()
    plan = plan_cleanup(marks, False, vss, bound, (ip_network("10.96.0.10/32"),))
    assert VirtualKey(4, "tcp", "10.96.0.10", 80) not in plan.virtual_servers
    assert VirtualKey(4, "tcp", "10.96.0.11", 80) in plan.virtual_servers


def test_a_virtual_server_whose_real_servers_are_not_all_kpxs_endpoints_stays() -> None:
    marks, _vss, _bound = kpx_node()
    mixed = VirtualKey(4, "tcp", "192.168.1.10", 31000)
    plan = plan_cleanup(marks, False, {mixed: [("10.244.1.5", 8080), ("10.9.9.9", 80)]}, set())
    assert plan.virtual_servers == ()


# `nft -j list table ip6 kpx-ipvs` (nft 1.0.6), addresses as nft prints them.
NFT_JSON_V6 = json.dumps(
    {
        "nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"table": {"family": "ip6", "name": "kpx-ipvs", "handle": 1}},
            {
                "set": {
                    "family": "ip6",
                    "name": "cluster-ips",
                    "table": "kpx-ipvs",
                    "type": ["ipv6_addr", "inet_proto", "inet_service"],
                    "handle": 1,
                    "elem": [{"concat": ["fd00:96::a", "tcp", 80]}],
                }
            },
            {
                "set": {
                    "family": "ip6",
                    "name": "masquerade-ips",
                    "table": "kpx-ipvs",
                    "type": ["ipv6_addr", "inet_proto", "inet_service"],
                    "handle": 2,
                }
            },
            {
                "set": {
                    "family": "ip6",
                    "name": "hairpin",
                    "table": "kpx-ipvs",
                    "type": ["ipv6_addr", "inet_proto", "inet_service", "ipv6_addr"],
                    "handle": 3,
                    "elem": [{"concat": ["fd00:244::5", "udp", 53, "fd00:244::5"]}],
                }
            },
        ]
    }
)


def test_parse_marks_reads_the_sets_and_normalises_addresses() -> None:
    marks = parse_marks({"ip": None, "ip6": NFT_JSON_V6})
    assert marks.families == {6}
    assert marks.virtual_servers == {(6, "tcp", "fd00:96::a", 80)}
    assert marks.endpoints == {("fd00:244::5", "udp", 53)}
    # The kernel's spelling of the same address matches.
    key = VirtualKey(6, "tcp", "fd00:96:0:0:0:0:0:a", 80)
    assert plan_cleanup(marks, False, {key: []}, set()).virtual_servers == (key,)


def test_kube_proxys_ipvs_mode_is_recognised_by_its_own_chains() -> None:
    ipvs_mode = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-IPVS-FILTER - [0:0]\nCOMMIT\n"
    iptables_mode = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\nCOMMIT\n"
    assert ipvs_mode_chains("filter", ipvs_mode) == {"KUBE-IPVS-FILTER"}
    assert ipvs_mode_chains("nat", ipvs_mode) == set()
    assert ipvs_mode_chains("nat", iptables_mode) == set()


def test_virtual_servers_with_connections_drain_before_they_go() -> None:
    a, b, c = (VirtualKey(4, "TCP", f"10.96.0.{i}", 80) for i in (1, 2, 3))
    # b has connections through it (active or inactive), c none known
    assert draining([a, b, c], {a: 0, b: 3}) == ([a, c], [b])
    assert draining([], {a: 1}) == ([], [])
