"""The node-local model: a pure function of (Service, EndpointSlices, Node) to ServicePorts.

Every Service behaviour is decided here, once, for all backends: which service ports exist per
IP family, which endpoints are usable for cluster and for external traffic on this node
(readiness, serving-and-terminating fallback, topology hints and trafficDistribution, traffic
policies), session affinity, and the addresses a port answers on. Values from the cluster are
parsed here (addresses, ports, protocols); whatever does not parse is left out and reported.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .detect_local import local_pods
from .external_ips import ExternalIPPolicy
from .kube_cidr import parse_cidr_sloppy
from .service_problems import EXTERNAL_IP_REFUSED, SOURCE_RANGES_UNUSABLE, ServiceProblem
from .types import (
    IP,
    DataplaneSettings,
    Endpoint,
    EndpointConditions,
    IPAddress,
    IPNetwork,
    NodeFacts,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)

log = logging.getLogger(__name__)

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
ZONE_LABEL = "topology.kubernetes.io/zone"
TOPOLOGY_MODE_ANNOTATIONS = (
    "service.kubernetes.io/topology-mode",
    "service.kubernetes.io/topology-aware-hints",
)
DEFAULT_AFFINITY_TIMEOUT = 10800
_PROTOCOLS = {"TCP": Protocol.TCP, "UDP": Protocol.UDP, "SCTP": Protocol.SCTP}
_FAMILY_OF_SLICE = {"IPv4": 4, "IPv6": 6}

Obj = Mapping[str, Any]
#: The externalIPs policy with nothing known of the node or the apiserver (tools and tests).
DEFAULT_EXTERNAL_IPS = ExternalIPPolicy()


class EndpointFields:
    """An endpoint of an EndpointSlice kept as attributes, not a dict (the store's compact
    form, `store/compact.py`): `addresses` (its one address as a str, several in a tuple; a
    plain str is an address in canonical form), `conditions`, `hints`, `nodeName`, `zone`,
    each None when absent. The model reads these directly; any other endpoint is read as the
    mapping the API sends."""

    __slots__ = ()
    addresses: Any
    conditions: Any
    hints: Any
    nodeName: Any
    zone: Any


def _ip(value: object) -> IPAddress | None:
    ip = IP.parse(value)
    if ip is None:
        log.warning("ignoring invalid IP address %r", value)
    return ip


_AF = {4: socket.AF_INET, 6: socket.AF_INET6}


def _ip_of_family(value: object, af: int) -> str | None:
    """An endpoint address of the slice's family, validated as IP.parse does (a plain IPv4
    address is kept as written, IPv6 in canonical form); None for an invalid address (logged)
    or one of the other family."""
    if type(value) is str and af == socket.AF_INET:
        try:
            socket.inet_pton(af, value)
        except OSError:
            pass
        else:
            return value
    ip = _ip(value)
    if ip is not None and _AF[ip.version] != af:
        return None
    return ip


def _net(value: object) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(str(value).strip(), strict=False)
    except ValueError:
        log.warning("ignoring invalid CIDR %r", value)
        return None


def _port(value: object) -> int:
    """A valid port number, or 0 when absent or invalid."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535:
        return value
    return 0


def nodeport_networks(
    settings: DataplaneSettings, node: NodeInfo, family: int
) -> tuple[IPNetwork, ...] | None:
    """Where NodePorts answer, in one family (backends add "and the address is local"):
    the configured nodePortAddresses networks; else the node's own addresses of that family
    ("primary", as upstream: none of that family means no NodePorts in it); else, while the
    Node's addresses are not known at all, None: every local address except loopback
    (NodePorts on 127.0.0.1 need route_localnet: backends add them with localhostNodePorts,
    NodeFacts.localhost_node_ports)."""
    if settings.node_port_networks:
        return tuple(net for net in settings.node_port_networks if net.version == family)
    if not node.addresses:
        return None
    return tuple(ipaddress.ip_network(a) for a in node.addresses if a.version == family)


def node_facts(settings: DataplaneSettings, node: NodeInfo) -> dict[int, NodeFacts]:
    """Everything a backend renders about this node, per family, decided once for all
    modes: the NodePort networks with their fallback, the detectLocal match, and whether
    NodePorts answer on localhost (IPv4 only: iptables mode as upstream, nftables as kpx's
    opt-in)."""
    return {
        family: NodeFacts(
            family=family,
            nodeport_networks=nodeport_networks(settings, node, family),
            local_pods=local_pods(settings, node, family),
            localhost_node_ports=family == 4 and settings.localhost_node_ports,
        )
        for family in (4, 6)
    }


def local_state(
    node: NodeInfo, settings: DataplaneSettings, services: Iterable[ServicePort] = ()
) -> NodeLocalState:
    """A node-local state with its facts (what the proxier keeps; for tools and tests)."""
    return NodeLocalState(
        node=node, services={sp.key: sp for sp in services}, facts=node_facts(settings, node)
    )


def node_info(node: Obj | None, node_name: str) -> NodeInfo:
    """What the model needs of this node: its addresses (InternalIP first), zone, pod CIDRs."""
    if node is None:
        return NodeInfo(name=node_name)
    status = node.get("status") or {}
    addrs: list[IPAddress] = []
    for wanted in ("InternalIP", "ExternalIP"):
        for a in status.get("addresses") or []:
            if a.get("type") == wanted and (ip := _ip(a.get("address"))) and ip not in addrs:
                addrs.append(ip)
    labels = dict((node.get("metadata") or {}).get("labels") or {})
    spec = node.get("spec") or {}
    cidrs = [n for c in spec.get("podCIDRs") or [] if (n := _net(c)) is not None]
    return NodeInfo(
        name=node_name,
        addresses=tuple(addrs),
        zone=str(labels.get(ZONE_LABEL, "")),
        pod_cidrs=tuple(cidrs),
    )


class _Candidate(NamedTuple):
    """An endpoint address from a slice, with its conditions and hints, before filtering."""

    endpoint: Endpoint
    ready: bool
    serving: bool
    terminating: bool
    zone_hints: frozenset[str] | None
    node_hints: frozenset[str] | None

    @property
    def local(self) -> bool:
        return self.endpoint.local


_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (hot path)
_NO_CONDITIONS: Obj = {}


def _candidates(
    slices: Iterable[Obj], family: int, port_name: str, protocol: Protocol, node_name: str
) -> tuple[list[_Candidate], dict[str, EndpointConditions]]:
    """All endpoints of the slices for one service port and family, de-duplicated by address;
    and the conditions of those that are not plainly ready (READY), by address.

    The hot loop of a full sync (once per endpoint): no function call per endpoint for the
    usual plain IPv4 address with plain conditions."""
    seen: dict[str, _Candidate] = {}
    unusual: dict[str, EndpointConditions] = {}
    af = _AF[family]
    plain_v4 = af == socket.AF_INET
    pton = socket.inet_pton
    for sl in slices:
        if _FAMILY_OF_SLICE.get(str(sl.get("addressType"))) != family:
            continue
        port = 0
        for p in sl.get("ports") or []:
            if (p.get("name") or "") == port_name and _PROTOCOLS.get(
                str(p.get("protocol") or "TCP")
            ) == protocol:
                port = _port(p.get("port"))
                break
        if not port:
            continue
        for ep in sl.get("endpoints") or []:
            # The first address is the one to use.
            if isinstance(ep, EndpointFields):  # attributes: no method call per field
                addresses, cond, hints, ep_node = ep.addresses, ep.conditions, ep.hints, ep.nodeName
                if not addresses:
                    continue
                # The store's: one address as itself, several in a tuple; a plain str is
                # an address in canonical form (store/compact.py).
                addr = addresses if isinstance(addresses, str) else addresses[0]
                checked = True
            else:
                addresses, cond = ep.get("addresses"), ep.get("conditions")
                hints, ep_node = ep.get("hints"), ep.get("nodeName")
                if not addresses:
                    continue
                addr = addresses[0]
                checked = False
            ip: str | None = None
            if type(addr) is str:
                if addr in seen:
                    continue
                if checked:  # as is
                    if (":" in addr) == (not plain_v4):
                        ip = addr
                elif plain_v4:
                    try:
                        pton(af, addr)
                        ip = addr
                    except OSError:
                        pass
            elif type(addr) is IP:  # canonical, as `parse` made it
                if addr in seen:
                    continue
                if (":" in addr) == (not plain_v4):
                    ip = addr
            if ip is None:
                ip = _ip_of_family(addr, af)
                if ip is None or ip in seen:
                    continue
            cond = cond or _NO_CONDITIONS
            ready = cond.get("ready") is not False  # nil means ready
            serving = cond.get("serving")
            serving = ready if serving is None else bool(serving)
            terminating = bool(cond.get("terminating"))
            if terminating or not (ready and serving):
                unusual[ip] = EndpointConditions(ready, serving, terminating)
            zones = nodes = None
            if hints:
                if hints.get("forZones") is not None:
                    zones = frozenset(str(z.get("name")) for z in hints["forZones"])
                if hints.get("forNodes") is not None:
                    nodes = frozenset(str(n.get("name")) for n in hints["forNodes"])
            local = bool(node_name) and ep_node == node_name
            seen[ip] = _new(
                _Candidate,
                (_new(Endpoint, (ip, port, local)), ready, serving, terminating, zones, nodes),
            )
    return sorted(seen.values()), unusual


def serving_addresses(slices: Iterable[Obj], key: ServicePortKey) -> frozenset[str]:
    """The addresses of every serving endpoint of one service port in its family (its
    `serving` condition holds: terminating or not, wherever topology or traffic policies send
    traffic): the
    endpoints whose conntrack entries live on (upstream kube-proxy's conntrack cleanup keeps
    the entries whose reply comes from one of them)."""
    cands, _ = _candidates(slices, key.family, key.port_name, key.protocol, "")
    return frozenset([c.endpoint.ip for c in cands if c.serving])


def _usable(cands: list[_Candidate]) -> list[_Candidate]:
    """Ready endpoints; when none is ready, the serving-and-terminating ones (KEP-1669)."""
    ready = [c for c in cands if c.ready]
    if ready:
        return ready
    return [c for c in cands if c.serving and c.terminating]


def _conditions(
    unusual: Mapping[str, EndpointConditions], *lists: tuple[Endpoint, ...]
) -> tuple[tuple[str, EndpointConditions], ...]:
    """The unusual conditions of the endpoints in these lists, ordered by address (the
    endpoints left out, not usable, are not described)."""
    used = {e.ip for endpoints in lists for e in endpoints}
    return tuple(sorted((ip, c) for ip, c in unusual.items() if ip in used))


def uses_topology(service: Obj) -> bool:
    """Whether the Service asks for topology-aware routing (trafficDistribution or the
    topology-mode annotations): only these read the node's zone."""
    spec = service.get("spec") or {}
    if spec.get("trafficDistribution"):
        return True
    annotations = (service.get("metadata") or {}).get("annotations")
    if not annotations:  # most Services: no generator to run (twice per Service and sync)
        return False
    return any(
        str(annotations.get(a, "")).lower() in ("auto", "true") for a in TOPOLOGY_MODE_ANNOTATIONS
    )


def _topology_filter(service: Obj, cands: list[_Candidate], node: NodeInfo) -> list[_Candidate]:
    """Apply EndpointSlice hints (topology-aware routing, trafficDistribution) as upstream does.

    Hints are used only when the Service asks for them and every usable endpoint carries them;
    otherwise (and when the hints leave nothing for this node) all endpoints are used.
    """
    if not cands or not uses_topology(service):
        return cands
    if all(c.node_hints is not None for c in cands):
        same_node = [c for c in cands if c.node_hints and node.name in c.node_hints]
        if same_node:
            return same_node
    if not node.zone or not all(c.zone_hints is not None for c in cands):
        return cands
    same_zone = [c for c in cands if c.zone_hints and node.zone in c.zone_hints]
    return same_zone or cands


def _affinity_timeout(spec: Obj) -> int:
    if spec.get("sessionAffinity") != "ClientIP":
        return 0
    cfg = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}).get("timeoutSeconds")
    if isinstance(cfg, int) and 0 < cfg <= 86400:
        return cfg
    return DEFAULT_AFFINITY_TIMEOUT


def is_proxied(service: Obj) -> bool:
    """False for Services this agent must ignore (another proxy's, ExternalName, headless)."""
    labels = (service.get("metadata") or {}).get("labels") or {}
    if SERVICE_PROXY_NAME_LABEL in labels:
        return False
    spec = service.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return False
    ips = spec.get("clusterIPs") or [spec.get("clusterIP")]
    return bool(ips) and ips[0] not in (None, "", "None")


class ServiceModel(NamedTuple):
    """What the model makes of one Service: its ports, and what it leaves out (problems)."""

    ports: list[ServicePort]
    problems: tuple[ServiceProblem, ...] = ()


def _source_ranges(namespace: str, name: str, spec: Obj) -> tuple[list[IPNetwork], list[str], bool]:
    """spec.loadBalancerSourceRanges read as Kubernetes reads them (kube_cidr): the usable
    ranges, the entries that are not, and whether the Service lists any entry at all."""
    listed = spec.get("loadBalancerSourceRanges") or []
    usable: list[IPNetwork] = []
    unusable: list[str] = []
    for entry in listed:
        try:
            usable.append(parse_cidr_sloppy(str(entry).strip()))
        except ValueError:
            unusable.append(str(entry))
    if unusable:
        log.warning(
            "%s/%s: ignoring loadBalancerSourceRanges entries that are not CIDRs: %s",
            namespace,
            name,
            ", ".join(map(repr, unusable)),
        )
    return usable, unusable, bool(listed)


def _closed_problem(
    namespace: str, name: str, family: int, lb_ips: list[IPAddress], unusable: list[str]
) -> ServiceProblem:
    why = (
        "its entries " + ", ".join(map(repr, unusable)) + " are not CIDRs"
        if unusable
        else f"it lists no IPv{family} range"
    )
    return ServiceProblem(
        namespace,
        name,
        SOURCE_RANGES_UNUSABLE,
        f"loadBalancerSourceRanges has no usable IPv{family} range ({why}): traffic to the "
        f"load-balancer IPs {', '.join(lb_ips)} is dropped from every source",
    )


def service_ports(
    service: Obj,
    slices: Iterable[Obj],
    node: NodeInfo,
    external_ips: ExternalIPPolicy = DEFAULT_EXTERNAL_IPS,
) -> list[ServicePort]:
    """The node-local ServicePorts of one Service: one per (port, IP family)."""
    return service_model(service, slices, node, external_ips).ports


def _external_ips(
    namespace: str, name: str, spec: Obj, policy: ExternalIPPolicy, problems: set[ServiceProblem]
) -> list[IPAddress]:
    """spec.externalIPs that parse and that the policy allows (external_ips.py); the others
    are reported."""
    allowed = []
    for value in spec.get("externalIPs") or []:
        ip = _ip(value)
        if ip is None:
            continue
        why = policy.refusal(ip)
        if why is None:
            allowed.append(ip)
        else:
            problems.add(
                ServiceProblem(
                    namespace,
                    name,
                    EXTERNAL_IP_REFUSED,
                    f"externalIP {ip} is not programmed: {why}",
                )
            )
    return allowed


def service_model(
    service: Obj,
    slices: Iterable[Obj],
    node: NodeInfo,
    external_ips: ExternalIPPolicy = DEFAULT_EXTERNAL_IPS,
) -> ServiceModel:
    """The node-local ServicePorts of one Service (one per port and IP family), and the
    problems of what is left out of them."""
    if not is_proxied(service):
        return ServiceModel([])
    meta = service.get("metadata") or {}
    spec = service.get("spec") or {}
    status = service.get("status") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    svc_type = spec.get("type") or "ClusterIP"
    external_capable = svc_type in ("NodePort", "LoadBalancer")

    cluster_ips = [ip for v in spec.get("clusterIPs") or [spec.get("clusterIP")] if (ip := _ip(v))]
    problems: set[ServiceProblem] = set()
    allowed_external = _external_ips(namespace, name, spec, external_ips, problems)
    lb_ips: list[IPAddress] = []
    if svc_type == "LoadBalancer":
        for ing in (status.get("loadBalancer") or {}).get("ingress") or []:
            # ipMode Proxy: the load balancer proxies; traffic never carries the LB IP here.
            if ing.get("ip") and ing.get("ipMode") != "Proxy" and (ip := _ip(ing["ip"])):
                lb_ips.append(ip)
    source_ranges, unusable_ranges, ranges_listed = _source_ranges(namespace, name, spec)
    etp_local = external_capable and spec.get("externalTrafficPolicy") == "Local"
    itp_local = spec.get("internalTrafficPolicy") == "Local"
    affinity = _affinity_timeout(spec)
    hc_port = _port(spec.get("healthCheckNodePort")) if etp_local else 0
    slices = list(slices)

    result: list[ServicePort] = []
    for family in sorted({ip.version for ip in cluster_ips}):
        fam_cluster = tuple(ip for ip in cluster_ips if ip.version == family)
        fam_ranges = tuple(n for n in source_ranges if n.version == family)
        fam_lb = [ip for ip in lb_ips if ip.version == family]
        # Fail closed: ranges listed, none usable in this family -> no source gets in.
        closed = ranges_listed and not fam_ranges
        if closed and fam_lb:
            problems.add(_closed_problem(namespace, name, family, fam_lb, unusable_ranges))
        for p in spec.get("ports") or []:
            protocol = _PROTOCOLS.get(str(p.get("protocol") or "TCP"))
            port = _port(p.get("port"))
            if protocol is None or not port:
                log.warning("%s/%s: ignoring invalid port %r", namespace, name, p)
                continue
            port_name = str(p.get("name") or "")
            cands, unusual = _candidates(slices, family, port_name, protocol, node.name)
            usable_all = _topology_filter(service, _usable(cands), node)
            local = (
                _usable([c for c in cands if c.endpoint.local]) if itp_local or etp_local else []
            )
            cluster_eps = tuple([c.endpoint for c in (local if itp_local else usable_all)])
            external_eps = (
                cluster_eps
                if itp_local == etp_local
                else tuple([c.endpoint for c in (local if etp_local else usable_all)])
            )
            short_circuit = (
                ()
                if not etp_local
                else cluster_eps
                if not itp_local
                else tuple([c.endpoint for c in usable_all])
            )
            key = ServicePortKey(namespace, name, port_name, protocol, family)
            result.append(
                ServicePort(
                    key=key,
                    port=port,
                    cluster_ips=fam_cluster,
                    external_ips=tuple(ip for ip in allowed_external if ip.version == family),
                    load_balancer_ips=tuple(fam_lb),
                    node_port=_port(p.get("nodePort")) if external_capable else 0,
                    cluster_endpoints=cluster_eps,
                    external_endpoints=external_eps,
                    external_masquerade=not etp_local,
                    # Drop, not reject, only while the Service has endpoints elsewhere
                    # (upstream: with none at all, both kinds of traffic are rejected).
                    drop_when_no_cluster_endpoints=itp_local and bool(usable_all),
                    drop_when_no_external_endpoints=etp_local and bool(usable_all),
                    affinity_timeout=affinity,
                    load_balancer_source_ranges=fam_ranges,
                    load_balancer_closed=closed,
                    health_check_node_port=hc_port,
                    short_circuit_endpoints=short_circuit,
                    endpoint_conditions=(
                        _conditions(unusual, cluster_eps, external_eps, short_circuit)
                        if unusual
                        else ()
                    ),
                )
            )
    return ServiceModel(result, tuple(sorted(problems)))
