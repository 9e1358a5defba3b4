"""Pure rendering of the nftables ruleset: the fixed table skeleton and each port's elements.

The ruleset's size does not grow with Services in chains or rules: every Service port is a
handful of map elements. A VIP is dispatched by a verdict map to `endpoints-<n>` (one chain per
distinct endpoint count), whose single rule DNATs through one shared map keyed by
`vip . protocol . port . (numgen random mod n)`. Loading 10,000 Services means loading map
elements, which the kernel does fast; changing one endpoint changes a few elements.

All text here is formatted from parsed values (ipaddress objects, enums, ints): nothing from
the cluster is pasted in as it came.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network, collapse_addresses

from ...localnet import (
    Endpoint,
    IPNetwork,
    LocalPods,
    NodeFacts,
    ProxySettings,
    ServicePort,
)
from . import names as n
from .schema import TABLE_SETS, Element, Goto, Key, SetDecl, affinity_set, endpoint_map

PRIORITY_DSTNAT = -100  # nft 1.0.6 rejects the name `dstnat` on an output hook
PRIORITY_SRCNAT = 100
PRIORITY_FILTER = -1  # just before the default filter priority
PRIORITY_FIREWALL = -110  # before DNAT, while the destination is still the load balancer IP


@dataclass(frozen=True)
class ChainDef:
    """A chain one service port owns (session affinity), with the sets its rules use."""

    sets: tuple[SetDecl, ...]
    rules: tuple[str, ...]


@dataclass
class PortRender:
    """What one service port contributes: set/map elements, and chains of its own."""

    elements: list[Element] = field(default_factory=list)
    chains: dict[str, ChainDef] = field(default_factory=dict)


def _affinity_chain(
    sp: ServicePort, endpoints: tuple[Endpoint, ...], family: int
) -> tuple[str, ChainDef]:
    """Upstream's affinity scheme: a timed set of recent clients per endpoint.

    A client found in an endpoint's set goes back to it; otherwise one endpoint is picked at
    random (a cascade of `numgen random mod k`), and the client is recorded in its set.
    Sets are named after the endpoint, so a removed endpoint takes its clients' affinity along.
    """
    name = n.affinity_chain(sp.key, sp.affinity_timeout, [str(e) for e in endpoints])
    saddr, fam, proto = n.SADDR[family], n.FAMILIES[family], sp.protocol.value
    sets, sticky, pick = [], [], []
    for i, ep in enumerate(endpoints):
        set_name = n.affinity_set(name, ep.ip, ep.port)
        sets.append(affinity_set(set_name, sp.affinity_timeout))
        target = f"[{ep.ip}]:{ep.port}" if family == 6 else f"{ep.ip}:{ep.port}"
        dnat = f"meta l4proto {proto} dnat {fam} to {target}"
        sticky.append(f"{saddr} @{set_name} {dnat}")
        left = len(endpoints) - i
        chance = f"numgen random mod {left} == 0 " if left > 1 else ""
        pick.append(f"{chance}update @{set_name} {{ {saddr} }} {dnat}")
    return name, ChainDef(tuple(sets), tuple(sticky + pick))


def _dispatch(
    out: PortRender,
    sp: ServicePort,
    vip_key: Key,
    endpoints: tuple[Endpoint, ...],
    drop: bool,
    nodeport: bool,
) -> None:
    if not endpoints:
        if nodeport:
            out.elements.append((n.DROP_NODEPORTS if drop else n.REJECT_NODEPORTS, vip_key, None))
        else:
            out.elements.append((n.DROP_IPS if drop else n.REJECT_IPS, vip_key, None))
        return
    _dispatch_to(out, sp, vip_key, endpoints, n.SERVICE_NODEPORTS if nodeport else n.SERVICE_IPS)


def _dispatch_to(
    out: PortRender,
    sp: ServicePort,
    vip_key: Key,
    endpoints: tuple[Endpoint, ...],
    dispatch_map: str,
) -> None:
    """`vip_key` in `dispatch_map` jumps to a chain picking one of `endpoints`."""
    if sp.affinity_timeout:
        chain, definition = _affinity_chain(sp, endpoints, sp.family)
        out.chains[chain] = definition
        out.elements.append((dispatch_map, vip_key, Goto(chain)))
        return
    chain = endpoint_map = n.endpoint_chain_of(dispatch_map, len(endpoints))
    out.elements.append((dispatch_map, vip_key, Goto(chain)))
    out.elements += [
        (endpoint_map, (*vip_key, i), (ip, port)) for i, (ip, port, _local) in enumerate(endpoints)
    ]


def _merged(nets: tuple[IPNetwork, ...]) -> list[IPNetwork]:
    """The same addresses with overlaps merged (one family per service port)."""
    v4 = [x for x in nets if isinstance(x, IPv4Network)]
    v6 = [x for x in nets if isinstance(x, IPv6Network)]
    return [*collapse_addresses(v4), *collapse_addresses(v6)]


def render_port(sp: ServicePort) -> PortRender:
    """The elements (and affinity chains) one service port contributes to its family's table."""
    out = PortRender()
    proto, port = sp.protocol, sp.port
    cluster, external = sp.cluster_endpoints, sp.external_endpoints
    for ip in sp.cluster_ips:
        key: Key = (ip, proto, port)
        out.elements.append((n.CLUSTER_IPS, key, None))
        _dispatch(out, sp, key, cluster, sp.drop_when_no_cluster_endpoints, nodeport=False)
    short_circuit = sp.short_circuit_endpoints
    for ip in (*sp.external_ips, *sp.load_balancer_ips):
        key = (ip, proto, port)
        if sp.external_masquerade:
            out.elements.append((n.EXTERNAL_IPS, key, None))
        _dispatch(out, sp, key, external, sp.drop_when_no_external_endpoints, nodeport=False)
        if short_circuit:
            out.elements.append((n.SHORT_CIRCUIT_IP_KEYS, key, None))
            _dispatch_to(out, sp, key, short_circuit, n.SHORT_CIRCUIT_IPS)
    for ip in sp.load_balancer_ips:
        if sp.load_balancer_source_ranges:
            key = (ip, proto, port)
            out.elements.append((n.FIREWALL_IPS, key, None))
            # Overlapping ranges would conflict in an interval set: merge them first.
            for net in _merged(sp.load_balancer_source_ranges):
                out.elements.append((n.FIREWALL_ALLOW, (*key, net), None))
    if sp.node_port:
        key = (proto, sp.node_port)
        if sp.external_masquerade:
            out.elements.append((n.EXTERNAL_NODEPORTS, key, None))
        _dispatch(out, sp, key, external, sp.drop_when_no_external_endpoints, nodeport=True)
        if short_circuit:
            out.elements.append((n.SHORT_CIRCUIT_NODEPORT_KEYS, key, None))
            _dispatch_to(out, sp, key, short_circuit, n.SHORT_CIRCUIT_NODEPORTS)
    for ep in sorted({e for e in (*cluster, *external, *short_circuit) if e.local}):
        out.elements.append((n.HAIRPIN, (ep.ip, ep.ip), None))
    return out


def port_elements(sp: ServicePort) -> list[Element]:
    return render_port(sp).elements


_DISPATCH_MAPS = frozenset(n.ENDPOINT_CHAIN_PREFIX)  # values: Goto(chain)


def endpoint_chain_counts(elements: list[Element]) -> set[tuple[str, int]]:
    """The (dispatch map, endpoint count) pairs whose chains and maps these elements need:
    the chains the dispatch elements jump to, and the maps endpoint elements go into (a
    Service whose VIP another Service claimed first still writes its endpoints, unused)."""
    names = {set_name for set_name, _, _ in elements}  # few distinct names: parse each once
    names |= {
        value.chain
        for set_name, _, value in elements
        if isinstance(value, Goto) and set_name in _DISPATCH_MAPS
    }
    return {found for name in names if (found := n.endpoint_count_of(name)) is not None}


# Each endpoint count `n` has its own chain and map, both named `endpoints-<n>` (or
# `nodeport-endpoints-<n>`), created the first time a sync needs them. One map per count keeps
# each map referenced by one rule: the kernel checks every element of a map against every rule
# that uses it, so one map shared by many chains costs elements x chains at load. And nft 1.0.6
# cannot add a rule that uses a `typeof ... th dport` map once that map is in the kernel
# ("conflicting protocols specified: ip vs. th"); it can in the transaction that creates the
# map, which is what a new count does.


def endpoint_chain(family: int, dispatch_map: str, count: int) -> tuple[str, SetDecl, str]:
    """Name, map and rule of the chain that picks one of `count` endpoints at random (the
    chain and its map share the name)."""
    daddr, fam = n.DADDR[family], n.FAMILIES[family]
    name = n.endpoint_chain_of(dispatch_map, count)
    if dispatch_map in n.NODEPORT_DISPATCH:
        key = "meta l4proto . th dport"
    else:
        key = f"{daddr} . meta l4proto . th dport"
    return (
        name,
        endpoint_map(dispatch_map, count),
        f"dnat {fam} to {key} . numgen random mod {count} map @{name}",
    )


@dataclass(frozen=True)
class ChainSpec:
    """A chain of the fixed table: base chains have a hook (type, hook, priority)."""

    name: str
    rules: tuple[str, ...]
    hook: tuple[str, str, int] | None = None  # (type, hook, priority); policy accept


@dataclass(frozen=True)
class TableDef:
    """A family's table without any Service's elements: its sets (with the elements that
    depend on the node only) and its fixed chains."""

    family: int
    sets: tuple[SetDecl, ...]
    elements: Mapping[str, tuple[Key, ...]]
    chains: tuple[ChainSpec, ...]


_ANY_BUT_LOOPBACK: dict[int, tuple[IPNetwork, ...]] = {
    4: tuple(IPv4Network("0.0.0.0/0").address_exclude(IPv4Network("127.0.0.0/8"))),
    6: (IPv6Network("::/0"),),  # ::1 cannot be DNATed off the node anyway
}


def nodeport_addresses(facts: NodeFacts) -> list[IPNetwork]:
    """The `nodeport-addresses` elements (NodeFacts.nodeport_networks: None is every
    local address but loopback)."""
    nets = facts.nodeport_networks
    found: tuple[IPNetwork, ...] = _ANY_BUT_LOOPBACK[facts.family] if nets is None else nets
    return sorted(found, key=str)


def local_pod_match(family: int, local: LocalPods, negate: bool = False) -> str:
    """The nft match of traffic from this node's pods (or, `negate`d, of all other traffic),
    '' when the detectLocal mode has nothing to match (then nothing counts as local). Only
    parsed networks and the validated interface name reach the text."""
    if not local.implemented:
        return ""
    op = "!= " if negate else ""
    if local.networks:
        nets = local.networks
        target = str(nets[0]) if len(nets) == 1 else f"@{n.LOCAL_POD_CIDRS}"
        return f"{n.SADDR[family]} {op}{target}"
    # iifname, a name match: valid before the interface exists, and it takes a prefix (`*`).
    name = local.interface or f"{local.interface_prefix}*"
    return f'iifname {op}"{name}"'


def base_table(settings: ProxySettings, facts: NodeFacts) -> TableDef:
    """The table with its sets, maps and fixed chains, without any Service's elements."""
    family = facts.family
    daddr, saddr = n.DADDR[family], n.SADDR[family]
    mark = f"0x{settings.masquerade_mark:08x}"
    set_mark = f"meta mark set meta mark | {mark}"
    match_vpp = f"{daddr} . meta l4proto . th dport"
    local_np = f"fib daddr type local {daddr} @{n.NODEPORT_ADDRESSES} meta l4proto . th dport"
    local = facts.local_pods
    is_local = local_pod_match(family, local)
    masq_cluster = ""
    if settings.masquerade_all:
        masq_cluster = f"{match_vpp} @{n.CLUSTER_IPS} {set_mark}"
    elif local.implemented:
        not_local = local_pod_match(family, local, negate=True)
        masq_cluster = f"{match_vpp} @{n.CLUSTER_IPS} {not_local} {set_mark}"
    pod_cidrs = local.networks if len(local.networks) > 1 else ()
    # externalTrafficPolicy Local: traffic from a local pod, or from the node itself (which is
    # masqueraded: its source is a node address), goes to every cluster endpoint.
    node_origin = "fib saddr type local"
    short_circuit = [
        *([f"{is_local} {match_vpp} vmap @{n.SHORT_CIRCUIT_IPS}"] if is_local else []),
        f"{node_origin} {match_vpp} @{n.SHORT_CIRCUIT_IP_KEYS} {set_mark}",
        f"{node_origin} {match_vpp} vmap @{n.SHORT_CIRCUIT_IPS}",
    ]
    short_circuit_np = [
        *([f"{is_local} {local_np} vmap @{n.SHORT_CIRCUIT_NODEPORTS}"] if is_local else []),
        f"{node_origin} {local_np} @{n.SHORT_CIRCUIT_NODEPORT_KEYS} {set_mark}",
        f"{node_origin} {local_np} vmap @{n.SHORT_CIRCUIT_NODEPORTS}",
    ]
    no_endpoints = f"ct state new jump {n.NO_ENDPOINTS}"
    chains = (
        ChainSpec(
            n.SERVICES,
            (
                *(rule for rule in (masq_cluster,) if rule),
                f"{match_vpp} @{n.EXTERNAL_IPS} {set_mark}",
                *short_circuit,
                f"{match_vpp} vmap @{n.SERVICE_IPS}",
                f"{local_np} @{n.EXTERNAL_NODEPORTS} {set_mark}",
                *short_circuit_np,
                f"{local_np} vmap @{n.SERVICE_NODEPORTS}",
            ),
        ),
        ChainSpec(
            n.NO_ENDPOINTS,
            (
                f"{match_vpp} @{n.REJECT_IPS} reject",
                f"{match_vpp} @{n.DROP_IPS} drop",
                f"{local_np} @{n.REJECT_NODEPORTS} reject",
                f"{local_np} @{n.DROP_NODEPORTS} drop",
            ),
        ),
        ChainSpec(
            n.FIREWALL,
            (f"{match_vpp} @{n.FIREWALL_IPS} {match_vpp} . {saddr} != @{n.FIREWALL_ALLOW} drop",),
        ),
        # Before DNAT, on both paths: traffic from pods and from the node itself.
        ChainSpec(
            n.FIREWALL_PREROUTING,
            (f"jump {n.FIREWALL}",),
            ("filter", "prerouting", PRIORITY_FIREWALL),
        ),
        ChainSpec(
            n.FIREWALL_OUTPUT, (f"jump {n.FIREWALL}",), ("filter", "output", PRIORITY_FIREWALL)
        ),
        ChainSpec(
            n.NAT_PREROUTING, (f"jump {n.SERVICES}",), ("nat", "prerouting", PRIORITY_DSTNAT)
        ),
        ChainSpec(n.NAT_OUTPUT, (f"jump {n.SERVICES}",), ("nat", "output", PRIORITY_DSTNAT)),
        ChainSpec(
            n.NAT_POSTROUTING,
            (
                f"meta mark & {mark} == {mark} meta mark set meta mark ^ {mark}"
                " masquerade fully-random",
                f"ct status dnat {saddr} . {daddr} @{n.HAIRPIN} masquerade fully-random",
            ),
            ("nat", "postrouting", PRIORITY_SRCNAT),
        ),
        ChainSpec(n.FILTER_INPUT, (no_endpoints,), ("filter", "input", PRIORITY_FILTER)),
        ChainSpec(n.FILTER_FORWARD, (no_endpoints,), ("filter", "forward", PRIORITY_FILTER)),
        ChainSpec(n.FILTER_OUTPUT, (no_endpoints,), ("filter", "output", PRIORITY_FILTER)),
    )
    elements = {
        n.NODEPORT_ADDRESSES: tuple((net,) for net in nodeport_addresses(facts)),
        n.LOCAL_POD_CIDRS: tuple((net,) for net in pod_cidrs),
    }
    return TableDef(family, TABLE_SETS, elements, chains)
