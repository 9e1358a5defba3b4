"""The shared semantics matrix: Service cases, packets, and what must happen to them.

One table for every backend and both tiers: tests/unit/test_semantics_matrix.py runs it
against the kernel fakes (no root), tests/e2e/test_semantics_matrix_kernel.py against the
real kernel in network namespaces (real packets). A case names its Service ports (built from
the endpoints b1, on this node, and b2, on another), its settings, a packet (who sends it,
to which address and port) and the outcomes allowed: the verdict, the DNAT target (which
endpoint answers) and whether the endpoint sees the node's address (masquerade).

The world (addresses match kpx_cluster.netns's plan for a three-node topology, so the
kernel tier can send the same packets): n1 is the proxy node (10.242.0.1); its pods b1 (an
endpoint) and client sit on the bridge cbr0 in 10.244.1.0/24; b2 and far are pods on n2
(10.244.2.0/24); n3 (ext) is a host outside the cluster.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import ip_network

from kpx_agent.backends.kernel.packet_walk import Outcome, Packet
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    DetectLocal,
    DetectLocalMode,
    Endpoint,
    NodeInfo,
    Protocol,
    ServicePort,
    ServicePortKey,
)

TCP, UDP = Protocol.TCP, Protocol.UDP


@dataclass(frozen=True)
class World:
    """The addresses of the matrix (per family)."""

    node: str
    node_v6: str
    b1: str  # endpoint on this node (client's bridge)
    b2: str  # endpoint on another node
    b1_v6: str
    b2_v6: str
    client: str  # a pod on this node
    client_v6: str
    rclient: str  # a routed (bridgeless) pod on this node
    far: str  # a pod on another node
    ext: str  # a host outside the cluster
    pod_cidr: str  # this node's
    pod_cidr_v6: str
    bridge: str = "cbr0"
    fabric: str = "eth0"
    routed_prefix: str = "vethr"  # interface prefix of routed (bridgeless) pods


WORLD = World(
    node="10.242.0.1",
    node_v6="fd00:242::1",
    b1="10.244.1.2",
    b2="10.244.2.2",
    b1_v6="fd00:244:1::2",
    b2_v6="fd00:244:2::2",
    client="10.244.1.5",
    client_v6="fd00:244:1::5",
    rclient="10.244.1.9",
    far="10.244.2.5",
    ext="10.242.0.3",
    pod_cidr="10.244.1.0/24",
    pod_cidr_v6="fd00:244:1::/64",
)
PORT = 8080  # every endpoint's port
VIP, VIP6 = "10.96.0.10", "fd00:96::10"
EXT_IP, LB_IP = "192.0.2.10", "192.0.2.21"
NODE_PORT = 30080


@dataclass(frozen=True)
class Case:
    name: str
    ports: Callable[[World], list[ServicePort]]
    sender: str  # client, far, ext, node, b1 (hairpin), rclient (routed pod on this node)
    dest: str  # vip, vip6, ext_ip, lb, node (the node's address, for NodePorts)
    port: int
    allowed: Callable[[World], set[Outcome]]
    settings: dict[str, object] = field(default_factory=dict)
    family: int = 4


def key(name: str, family: int = 4, proto: Protocol = TCP) -> ServicePortKey:
    return ServicePortKey("m", name, "", proto, family)


def ep(ip: str, local: bool = False) -> Endpoint:
    return Endpoint(IP.of(ip), PORT, local)


def both(w: World) -> tuple[Endpoint, ...]:
    return (ep(w.b1, True), ep(w.b2))


def svc(w: World, **kw: object) -> ServicePort:
    """A TCP port 80 Service on VIP with both endpoints, changed by `kw`."""
    base = ServicePort(
        key("web"),
        80,
        cluster_ips=(IP.of(VIP),),
        cluster_endpoints=both(w),
        external_endpoints=both(w),
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def to(*targets: str, masq: bool | dict[str, bool] = False) -> Callable[[World], set[Outcome]]:
    """Accepted and DNATed to one of `targets` (b1, b2, ...), masqueraded as `masq` says."""

    def allowed(w: World) -> set[Outcome]:
        out = set()
        for t in targets:
            m = masq.get(t, False) if isinstance(masq, dict) else masq
            out.add(Outcome("accept", (getattr(w, t), PORT), m))
        return out

    return allowed


def verdict(v: str) -> Callable[[World], set[Outcome]]:
    return lambda w: {Outcome(v)}


def lb(w: World, **kw: object) -> ServicePort:
    return svc(w, load_balancer_ips=(IP.of(LB_IP),), node_port=NODE_PORT, **kw)


def etp_local(w: World, local_eps: tuple[Endpoint, ...]) -> ServicePort:
    return lb(
        w,
        external_ips=(IP.of(EXT_IP),),
        external_endpoints=local_eps,
        external_masquerade=False,
        drop_when_no_external_endpoints=True,
        short_circuit_endpoints=both(w),
    )


ROUTED = "<routed-prefix>"  # in settings: the world's interface prefix of routed pods
CLUSTER_CIDR = {"cluster_cidrs": ("10.244.0.0/16", "fd00:244::/32")}

CASES: list[Case] = [
    # ClusterIP: pods keep their source; off-cluster sources are masqueraded.
    Case("clusterip-from-local-pod", lambda w: [svc(w)], "client", "vip", 80, to("b1", "b2")),
    Case("clusterip-from-remote-pod", lambda w: [svc(w)], "far", "vip", 80, to("b1", "b2")),
    Case("clusterip-from-outside", lambda w: [svc(w)], "ext", "vip", 80, to("b1", "b2", masq=True)),
    Case(
        "clusterip-other-port-untouched", lambda w: [svc(w)], "client", "vip", 81, verdict("accept")
    ),
    Case(
        "clusterip-no-endpoints-rejects",
        lambda w: [svc(w, cluster_endpoints=(), external_endpoints=())],
        "client",
        "vip",
        80,
        verdict("reject"),
    ),
    Case(
        "itp-local-no-local-endpoint-drops",
        lambda w: [svc(w, cluster_endpoints=(), drop_when_no_cluster_endpoints=True)],
        "client",
        "vip",
        80,
        verdict("drop"),
    ),
    Case(
        "affinity-picks-an-endpoint",
        lambda w: [svc(w, affinity_timeout=60)],
        "client",
        "vip",
        80,
        to("b1", "b2"),
    ),
    # Hairpin: b1 reaching itself through the VIP is masqueraded (its reply must come back).
    Case(
        "hairpin-masquerade", lambda w: [svc(w)], "b1", "vip", 80, to("b1", "b2", masq={"b1": True})
    ),
    # NodePort, externalIPs, load balancers (externalTrafficPolicy Cluster: masqueraded).
    Case(
        "nodeport-from-outside",
        lambda w: [lb(w)],
        "ext",
        "node",
        NODE_PORT,
        to("b1", "b2", masq=True),
    ),
    Case(
        "nodeport-no-endpoints-rejects",
        lambda w: [lb(w, cluster_endpoints=(), external_endpoints=())],
        "ext",
        "node",
        NODE_PORT,
        verdict("reject"),
    ),
    Case(
        "nodeport-outside-nodeport-addresses",
        lambda w: [lb(w)],
        "ext",
        "node",
        NODE_PORT,
        verdict("accept"),
        settings={"node_port_networks": ("10.99.0.0/16",)},
    ),
    Case(
        "external-ip-from-outside",
        lambda w: [svc(w, external_ips=(IP.of(EXT_IP),))],
        "ext",
        "ext_ip",
        80,
        to("b1", "b2", masq=True),
    ),
    Case("lb-from-outside", lambda w: [lb(w)], "ext", "lb", 80, to("b1", "b2", masq=True)),
    Case(
        "lb-source-range-allows",
        lambda w: [lb(w, load_balancer_source_ranges=(ip_network("10.242.0.0/24"),))],
        "ext",
        "lb",
        80,
        to("b1", "b2", masq=True),
    ),
    Case(
        "lb-source-range-drops-others",
        lambda w: [lb(w, load_balancer_source_ranges=(ip_network("198.51.100.0/24"),))],
        "ext",
        "lb",
        80,
        verdict("drop"),
    ),
    # Ranges listed but none usable in this family (the model's fail closed): every source
    # is dropped, none let through.
    Case(
        "lb-source-ranges-none-usable-drops",
        lambda w: [lb(w, load_balancer_closed=True)],
        "ext",
        "lb",
        80,
        verdict("drop"),
    ),
    Case(
        "lb-source-ranges-none-usable-drops-pods",
        lambda w: [lb(w, load_balancer_closed=True)],
        "client",
        "lb",
        80,
        verdict("drop"),
    ),
    # externalTrafficPolicy Local: external traffic to local endpoints only, source kept;
    # local pods and the node itself short-circuit to every endpoint.
    Case(
        "etp-local-external-keeps-source",
        lambda w: [etp_local(w, (ep(w.b1, True),))],
        "ext",
        "lb",
        80,
        to("b1"),
    ),
    Case(
        "etp-local-nodeport-keeps-source",
        lambda w: [etp_local(w, (ep(w.b1, True),))],
        "ext",
        "node",
        NODE_PORT,
        to("b1"),
    ),
    Case(
        "etp-local-no-local-endpoint-drops",
        lambda w: [etp_local(w, ())],
        "ext",
        "lb",
        80,
        verdict("drop"),
    ),
    Case(
        "etp-local-short-circuit-pod",
        lambda w: [etp_local(w, ())],
        "client",
        "lb",
        80,
        to("b1", "b2"),
    ),
    Case(
        "etp-local-short-circuit-pod-external-ip",
        lambda w: [etp_local(w, ())],
        "client",
        "ext_ip",
        80,
        to("b1", "b2"),
    ),
    Case(
        "etp-local-short-circuit-node",
        lambda w: [etp_local(w, ())],
        "node",
        "lb",
        80,
        to("b1", "b2", masq=True),
    ),
    # detectLocal modes: who is "from a local pod" (not masqueraded to a cluster IP).
    Case(
        "nodecidr-remote-pod-is-masqueraded",
        lambda w: [svc(w)],
        "far",
        "vip",
        80,
        to("b1", "b2", masq=True),
        settings={"detect": ("NodeCIDR", "")},
    ),
    Case(
        "nodecidr-local-pod-keeps-source",
        lambda w: [svc(w)],
        "client",
        "vip",
        80,
        to("b1", "b2"),
        settings={"detect": ("NodeCIDR", "")},
    ),
    Case(
        "bridge-local-pod-keeps-source",
        lambda w: [svc(w)],
        "client",
        "vip",
        80,
        to("b1", "b2"),
        settings={"detect": ("BridgeInterface", "cbr0")},
    ),
    Case(
        "bridge-remote-pod-is-masqueraded",
        lambda w: [svc(w)],
        "far",
        "vip",
        80,
        to("b1", "b2", masq=True),
        settings={"detect": ("BridgeInterface", "cbr0")},
    ),
    Case(
        "prefix-routed-pod-keeps-source",
        lambda w: [svc(w)],
        "rclient",
        "vip",
        80,
        to("b1", "b2"),
        settings={"detect": ("InterfaceNamePrefix", ROUTED)},
    ),
    Case(
        "prefix-bridged-pod-is-masqueraded",
        lambda w: [svc(w)],
        "client",
        "vip",
        80,
        to("b1", "b2", masq=True),
        settings={"detect": ("InterfaceNamePrefix", ROUTED)},
    ),
    Case(
        "nothing-to-match-nothing-masqueraded",
        lambda w: [svc(w)],
        "ext",
        "vip",
        80,
        to("b1", "b2"),
        settings={"cluster_cidrs": ()},
    ),
    Case(
        "masquerade-all",
        lambda w: [svc(w)],
        "client",
        "vip",
        80,
        to("b1", "b2", masq=True),
        settings={"masquerade_all": True},
    ),
    # Dual stack: the IPv6 port of the same Service, in its own table.
    Case(
        "dual-stack-ipv6-clusterip",
        lambda w: [
            svc(w),
            svc(
                w,
                key=key("web", 6),
                cluster_ips=(IP.of(VIP6),),
                cluster_endpoints=(ep(w.b1_v6, True), ep(w.b2_v6)),
                external_endpoints=(ep(w.b1_v6, True), ep(w.b2_v6)),
            ),
        ],
        "client",
        "vip6",
        80,
        to("b1_v6", "b2_v6"),
        family=6,
    ),
]


#: Cases whose ipvs outcome differs from the other modes, as upstream kube-proxy's ipvs mode
#: does: (item of "What ipvs mode does not do" in agents/kpx_agent/backends/ipvs/README.md,
#: the outcome ipvs mode gives instead). Both tiers judge the ipvs column by it
#: (tests/unit/test_semantics_matrix.py through the ipvs kernel fake,
#: tests/e2e/test_ipvs_semantics_matrix.py in a kernel with IPVS); every other case must pass
#: as in nftables and iptables modes.
IPVS_OUTCOMES: dict[str, tuple[str, Callable[[World], set[Outcome]]]] = {
    # 1. No externalTrafficPolicy Local short circuit. Upstream's ipvs proxier syncs the
    #    virtual server of a NodePort, external or load-balancer address with
    #    `onlyNodeLocalEndpoints` = the Service's ETP is Local (pkg/proxy/ipvs/proxier.go,
    #    syncEndpoint), and IPVS picks a real server by virtual server alone, whoever sends:
    #    with no endpoint on this node, a pod or the node reaching that address is dropped like
    #    outside traffic (kubernetes/kubernetes#93456). The iptables and nftables proxiers
    #    short-circuit such in-cluster traffic to every endpoint (their "ext" chains send
    #    traffic from local pods and the node to the Service's cluster chain).
    "etp-local-short-circuit-pod": ("1", verdict("drop")),
    "etp-local-short-circuit-pod-external-ip": ("1", verdict("drop")),
    "etp-local-short-circuit-node": ("1", verdict("drop")),
}


def ipvs_allowed(case: Case) -> Callable[[World], set[Outcome]]:
    """The outcomes ipvs mode may give for the case (IPVS_OUTCOMES, else the case's)."""
    return IPVS_OUTCOMES[case.name][1] if case.name in IPVS_OUTCOMES else case.allowed


def settings_of(case: Case, w: World = WORLD) -> DataplaneSettings:
    spec = {**CLUSTER_CIDR, **case.settings}
    mode, interface = spec.pop("detect", ("ClusterCIDR", ""))  # type: ignore[misc]
    interface = w.routed_prefix if interface == ROUTED else interface
    cidrs = spec.pop("cluster_cidrs")
    nets = spec.pop("node_port_networks", ())
    return DataplaneSettings(
        cluster_cidrs=tuple(ip_network(c) for c in cidrs),  # type: ignore[attr-defined]
        node_port_networks=tuple(ip_network(c) for c in nets),  # type: ignore[attr-defined]
        detect_local=DetectLocal(DetectLocalMode(mode), interface),
        **spec,  # type: ignore[arg-type]
    )


def node_of(w: World = WORLD) -> NodeInfo:
    """The proxy node n1 as the model sees it."""
    return NodeInfo(
        "n1",
        addresses=(IP.of(w.node), IP.of(w.node_v6)),
        pod_cidrs=(ip_network(w.pod_cidr), ip_network(w.pod_cidr_v6)),
    )


def packet(case: Case, w: World = WORLD) -> Packet:
    """The case's packet as it reaches the proxy node."""
    v6 = case.family == 6
    dest = {
        "vip": VIP,
        "vip6": VIP6,
        "ext_ip": EXT_IP,
        "lb": LB_IP,
        "node": w.node,
    }[case.dest]
    source, origin, iif = {
        "client": (w.client_v6 if v6 else w.client, "pod", w.bridge),
        "b1": (w.b1, "pod", w.bridge),
        "rclient": (w.rclient, "pod", f"{w.routed_prefix}1"),
        "far": (w.far, "external", w.fabric),
        "ext": (w.ext, "external", w.fabric),
        "node": (w.node, "node", ""),
    }[case.sender]
    return Packet(
        family=case.family,
        saddr=source,
        daddr=dest,
        protocol=TCP,
        dport=case.port,
        origin=origin,
        iif=iif,
        local_addresses=frozenset({w.node, w.node_v6, "127.0.0.1", "::1"}),
    )
