"""Pure rendering of the nftables ruleset: the fixed table skeleton and each port's elements.

The ruleset's size does not grow with Services in chains or rules: every Service port is a
handful of map elements. A VIP is dispatched by a verdict map to `endpoints-<n>` (one chain per
distinct endpoint count), whose single rule DNATs through one shared map keyed by
`vip . protocol . port . (numgen random mod n)`. Loading 10,000 Services means loading map
elements, which the kernel does fast; changing one endpoint changes a few elements.

Rules are typed values (`rules.Rule`), elements too (`schema.Element`): nothing here writes
nft text, and nothing from the cluster reaches a rule but parsed values (addresses, enums,
ints, networks) and the validated detectLocal interface name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Network, IPv6Network
from typing import cast

from ...model.types import (
    DataplaneSettings,
    Endpoint,
    IPNetwork,
    LocalPods,
    NodeFacts,
    ServicePort,
)
from ..kernel import nft_rules as r
from ..kernel.nft_rules import L4PROTO, PORT_KEY, Rule, rule
from ..kernel.nft_transaction import ChainSpec, TableDef
from ..source_ranges import common_ranges, merged
from . import names as n
from .element_book import Merge
from .schema import (
    TABLE_CHAINS,
    TABLE_SETS,
    Element,
    Goto,
    Key,
    KeyField,
    Pair,
    SetDecl,
    Value,
    affinity_set,
    endpoint_map,
    table_set,
)


@dataclass(frozen=True)
class ChainDef:
    """A chain one service port owns (session affinity), with the sets its rules use."""

    sets: tuple[SetDecl, ...]
    rules: tuple[Rule, ...]


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
    Sets are named after the port and the endpoint (`names.affinity_set`): a removed endpoint
    takes its clients' affinity along, the others keep theirs.
    """
    name = n.affinity_chain(
        sp.key, sp.affinity_timeout, [(ep.ip, ep.port, ep.local) for ep in endpoints]
    )
    saddr = r.saddr(family)
    is_proto = r.Compare(L4PROTO, sp.protocol)
    sets: list[SetDecl] = []
    sticky: list[Rule] = []
    pick: list[Rule] = []
    for i, ep in enumerate(endpoints):
        decl = affinity_set(
            n.affinity_set(sp.key, sp.affinity_timeout, ep.ip, ep.port), sp.affinity_timeout
        )
        sets.append(decl)
        dnat = r.Dnat(family, ep.ip, ep.port)
        sticky.append(rule(r.Lookup((saddr,), decl), is_proto, dnat))
        left = len(endpoints) - i
        chance = (r.RandomIs(left),) if left > 1 else ()
        pick.append(rule(*chance, r.SetUpdate(decl, saddr), is_proto, dnat))
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
    # One record element for the whole run (`kernel_pairs` makes it the kernel's elements).
    out.elements.append((endpoint_map, vip_key, endpoint_run(endpoints)))


def endpoint_run(endpoints: Sequence[Endpoint]) -> tuple[KeyField, ...]:
    """The record's value of a VIP's endpoints in its endpoint map: their addresses and ports,
    flat and in order, `(ip0, port0, ip1, port1, ...)`. The kernel holds one element per
    endpoint, `vip . protocol . port . i` -> `ip . port`; the record keeps the run as one
    element of the VIP's key. Memory: about 20 B per endpoint here, against about 250 B as an
    element of its own (its key and value tuples, its claim and its slot in the record; 100,000
    endpoints at 10,000 Services)."""
    return tuple(x for ep in endpoints for x in (ep.ip, ep.port))


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
        if sp.load_balancer_firewall:
            key = (ip, proto, port)
            out.elements.append((n.FIREWALL_IPS, key, None))
            # One element of the backend's record per address and port, its value all the
            # ranges (overlaps merged: they would conflict in an interval set); the kernel's
            # elements are `firewall_allow_pairs` of it, once merged with other Services'.
            ranges = merged(sp.load_balancer_source_ranges)
            out.elements.append((n.FIREWALL_ALLOW, key, ranges))
    if sp.node_port:
        key = (proto, sp.node_port)
        if sp.external_masquerade:
            out.elements.append((n.EXTERNAL_NODEPORTS, key, None))
        _dispatch(out, sp, key, external, sp.drop_when_no_external_endpoints, nodeport=True)
        if short_circuit:
            out.elements.append((n.SHORT_CIRCUIT_NODEPORT_KEYS, key, None))
            _dispatch_to(out, sp, key, short_circuit, n.SHORT_CIRCUIT_NODEPORTS)
    for local_ip in sorted({e.ip for e in (*cluster, *external, *short_circuit) if e.local}):
        out.elements.append((n.HAIRPIN, (local_ip, local_ip), None))
    return out


def port_elements(sp: ServicePort) -> list[Element]:
    return render_port(sp).elements


def firewall_ranges(values: Sequence[Value]) -> Value:
    """The `firewall-allow` value of an address and port several Services claim: the ranges
    they all allow (`source_ranges.common_ranges`)."""
    return common_ranges(_networks(v) for v in values)


#: Sets whose record holds one value per key merged across its owners (`element_book`).
MERGED_SETS: Mapping[str, Merge] = {n.FIREWALL_ALLOW: firewall_ranges}


#: Endpoint maps, by name (few names: each parsed once).
_ENDPOINT_MAPS: dict[str, bool] = {}


def is_endpoint_map(set_name: str) -> bool:
    """Whether `set_name` is an endpoint map (`endpoints-<n>`, ...), whose record elements are
    runs (`endpoint_run`)."""
    known = _ENDPOINT_MAPS.get(set_name)
    if known is None:
        known = _ENDPOINT_MAPS[set_name] = n.endpoint_count_of(set_name) is not None
    return known


def kernel_pairs(set_name: str, pairs: Iterable[Pair]) -> list[Pair]:
    """The kernel's elements of a set for the record's: a `firewall-allow` record element
    (address, protocol, port) -> ranges is one interval element per range; an endpoint map's
    record element VIP key -> run (`endpoint_run`) is one element per endpoint,
    `(*key, i) -> (ip, port)`."""
    return list(iter_kernel_pairs(set_name, pairs))


def iter_kernel_pairs(set_name: str, pairs: Iterable[Pair]) -> Iterator[Pair]:
    """`kernel_pairs`, made as they are consumed (a full sync's netlink load encodes 100,000
    endpoints at 10,000 Services: made all at once, they would be about 20 MB more at its
    peak)."""
    if set_name == n.FIREWALL_ALLOW:
        return (((*key, net), None) for key, ranges in pairs for net in _networks(ranges))
    if is_endpoint_map(set_name):
        return (
            ((*key, i >> 1), (run[i], run[i + 1]))
            for key, value in pairs
            for run in (cast(tuple[KeyField, ...], value),)
            for i in range(0, len(run), 2)
        )
    return iter(pairs)


def kernel_size(set_name: str, pairs: Iterable[Pair]) -> int:
    """How many kernel elements the record's `pairs` of `set_name` are (see `kernel_count`)."""
    count = kernel_count(set_name)
    if count is None:
        return sum(1 for _ in pairs)
    return sum(count(value) for _, value in pairs)


def kernel_count(set_name: str) -> Callable[[Value], int] | None:
    """How many kernel elements one record element of `set_name` is, where that is not one:
    an endpoint map's run is one per endpoint. (A `firewall-allow` element is counted as one:
    its intervals are the kernel's way of holding one allow list.)"""
    return _run_length if is_endpoint_map(set_name) else None


def _run_length(run: Value) -> int:
    return len(cast(tuple[KeyField, ...], run)) >> 1


def _networks(value: Value) -> list[IPNetwork]:
    return [x for x in value or () if isinstance(x, IPv4Network | IPv6Network)]


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


def endpoint_chain(family: int, dispatch_map: str, count: int) -> tuple[str, SetDecl, Rule]:
    """Name, map and rule of the chain that picks one of `count` endpoints at random (the
    chain and its map share the name)."""
    key = PORT_KEY if dispatch_map in n.NODEPORT_DISPATCH else r.vip_key(family)
    decl = endpoint_map(dispatch_map, count)
    dnat = rule(r.DnatMap(family, key, count, decl))
    # The rule's comment is a digest of the rule and its map as this version writes them: a
    # swap in place keeps an endpoint chain in the kernel only if its one rule carries it.
    digest = hashlib.sha256(f"{r.rule_text(dnat)}\n{decl.body(family)}".encode()).hexdigest()
    return decl.name, decl, replace(dnat, comment=f"kpx {digest[:16]}")


def endpoint_rule(family: int, name: str) -> Rule:
    """The rule of the endpoint chain `name` (an empty rule for a name that is not one)."""
    found = n.endpoint_count_of(name)
    if found is None:
        return Rule(())
    return endpoint_chain(family, *found)[2]


_LOOPBACK: dict[int, IPNetwork] = {4: IPv4Network("127.0.0.0/8"), 6: IPv6Network("::1/128")}


def _without(net: IPNetwork, hole: IPNetwork) -> tuple[IPNetwork, ...]:
    """`net` less the addresses of `hole` (same family)."""
    if not net.overlaps(hole):
        return (net,)
    if net.subnet_of(hole):  # type: ignore[arg-type]
        return ()
    return tuple(net.address_exclude(hole))  # type: ignore[arg-type]


def nodeport_addresses(facts: NodeFacts) -> list[IPNetwork]:
    """The `nodeport-addresses` elements: NodeFacts.nodeport_networks (None: every local
    address). IPv4 leaves 127.0.0.0/8 out (as upstream's nftables mode; IPv6 keeps ::1, which
    cannot be DNATed off the node anyway), except with localhost NodePorts
    (nftables.localhostNodePorts, IPv4 only): then it is in, as in iptables mode, added to
    the node's addresses or kept where a configured network holds it."""
    nets = facts.nodeport_networks
    if facts.family == 6:
        return sorted((IPv6Network("::/0"),) if nets is None else nets, key=str)
    loopback = _LOOPBACK[4]
    found: tuple[IPNetwork, ...] = (IPv4Network("0.0.0.0/0"),) if nets is None else nets
    if facts.localhost_node_ports:
        if not any(net.overlaps(loopback) for net in found):
            found = (*found, loopback)
    else:
        found = tuple(part for net in found for part in _without(net, loopback))
    return sorted(found, key=str)


def localnet_guard(facts: NodeFacts) -> tuple[Rule, ...]:
    """With localhost NodePorts, route_localnet=1 lets packets from anywhere reach
    127.0.0.0/8: drop those that do not come from loopback and are neither replies nor DNATed
    NodePort traffic (the iptables mode's KPX-LOCALNET, upstream's rule,
    https://issue.k8s.io/90259), in the input and output hooks."""
    if not facts.localhost_node_ports:
        return ()
    loopback = _LOOPBACK[4]
    return (
        rule(
            r.Compare(r.daddr(4), loopback),
            r.Compare(r.saddr(4), loopback, negate=True),
            r.CtState("established,related", negate=True),
            r.CtStatus("dnat", negate=True),
            r.Verdict.DROP,
        ),
    )


def local_pod_match(family: int, local: LocalPods, negate: bool = False) -> tuple[r.Statement, ...]:
    """The match of traffic from this node's pods (or, `negate`d, of all other traffic),
    none when the detectLocal mode has nothing to match (then nothing counts as local). Only
    parsed networks and the validated interface name reach the rule."""
    if not local.implemented:
        return ()
    if local.networks:
        nets = local.networks
        saddr = r.saddr(family)
        if len(nets) == 1:
            return (r.Compare(saddr, nets[0], negate),)
        return (r.Lookup((saddr,), table_set(n.LOCAL_POD_CIDRS), negate),)
    # iifname, a name match: valid before the interface exists, and it takes a prefix (`*`).
    return (r.IifName(local.interface or f"{local.interface_prefix}*", negate),)


def base_table(settings: DataplaneSettings, facts: NodeFacts) -> TableDef:
    """The table with its sets, maps and fixed chains, without any Service's elements."""
    family = facts.family
    daddr, saddr = r.daddr(family), r.saddr(family)
    vpp = r.vip_key(family)
    mark = settings.masquerade_mark
    set_mark = r.MarkOr(mark)

    def vip_in(set_name: str) -> r.Lookup:
        return r.Lookup(vpp, table_set(set_name))

    # A NodePort: to a local address NodePorts answer on, protocol . port in the set.
    local_np = (
        r.FibLocal(r.PacketField.DADDR),
        r.Lookup((daddr,), table_set(n.NODEPORT_ADDRESSES)),
    )

    def nodeport_in(set_name: str) -> tuple[r.Statement, ...]:
        return (*local_np, r.Lookup(PORT_KEY, table_set(set_name)))

    def vmap(set_name: str) -> r.Vmap:
        keys = PORT_KEY if set_name in n.NODEPORT_DISPATCH else vpp
        return r.Vmap(keys, table_set(set_name))

    local = facts.local_pods
    is_local = local_pod_match(family, local)
    masq_cluster: tuple[Rule, ...] = ()
    if settings.masquerade_all:
        masq_cluster = (rule(vip_in(n.CLUSTER_IPS), set_mark),)
    elif local.implemented:
        not_local = local_pod_match(family, local, negate=True)
        masq_cluster = (rule(vip_in(n.CLUSTER_IPS), *not_local, set_mark),)
    pod_cidrs = local.networks if len(local.networks) > 1 else ()
    # externalTrafficPolicy Local: traffic from a local pod, or from the node itself (which is
    # masqueraded: its source is a node address), goes to every cluster endpoint.
    node_origin = r.FibLocal(r.PacketField.SADDR)
    short_circuit = (
        *((rule(*is_local, vmap(n.SHORT_CIRCUIT_IPS)),) if is_local else ()),
        rule(node_origin, vip_in(n.SHORT_CIRCUIT_IP_KEYS), set_mark),
        rule(node_origin, vmap(n.SHORT_CIRCUIT_IPS)),
    )
    short_circuit_np = (
        *((rule(*is_local, *local_np, vmap(n.SHORT_CIRCUIT_NODEPORTS)),) if is_local else ()),
        rule(node_origin, *nodeport_in(n.SHORT_CIRCUIT_NODEPORT_KEYS), set_mark),
        rule(node_origin, *local_np, vmap(n.SHORT_CIRCUIT_NODEPORTS)),
    )
    no_endpoints = rule(r.CtState("new"), r.Jump(n.NO_ENDPOINTS))
    rules: dict[str, tuple[Rule, ...]] = {
        n.SERVICES: (
            *masq_cluster,
            rule(vip_in(n.EXTERNAL_IPS), set_mark),
            *short_circuit,
            rule(vmap(n.SERVICE_IPS)),
            rule(*nodeport_in(n.EXTERNAL_NODEPORTS), set_mark),
            *short_circuit_np,
            rule(*local_np, vmap(n.SERVICE_NODEPORTS)),
        ),
        n.NO_ENDPOINTS: (
            rule(vip_in(n.REJECT_IPS), r.Verdict.REJECT),
            rule(vip_in(n.DROP_IPS), r.Verdict.DROP),
            rule(*nodeport_in(n.REJECT_NODEPORTS), r.Verdict.REJECT),
            rule(*nodeport_in(n.DROP_NODEPORTS), r.Verdict.DROP),
        ),
        n.FIREWALL: (
            rule(
                vip_in(n.FIREWALL_IPS),
                r.Lookup((*vpp, saddr), table_set(n.FIREWALL_ALLOW), negate=True),
                r.Verdict.DROP,
            ),
        ),
        n.FIREWALL_PREROUTING: (rule(r.Jump(n.FIREWALL)),),
        n.FIREWALL_OUTPUT: (rule(r.Jump(n.FIREWALL)),),
        n.NAT_PREROUTING: (rule(r.Jump(n.SERVICES)),),
        n.NAT_OUTPUT: (rule(r.Jump(n.SERVICES)),),
        n.NAT_POSTROUTING: (
            rule(r.MarkIsSet(mark), r.MarkXor(mark), r.Masquerade()),
            rule(
                r.CtStatus("dnat"), r.Lookup((saddr, daddr), table_set(n.HAIRPIN)), r.Masquerade()
            ),
        ),
        n.FILTER_INPUT: (*localnet_guard(facts), no_endpoints),
        n.FILTER_FORWARD: (no_endpoints,),
        n.FILTER_OUTPUT: (*localnet_guard(facts), no_endpoints),
    }
    chains = tuple(ChainSpec(decl.name, rules[decl.name], decl.hook) for decl in TABLE_CHAINS)
    elements = {
        n.NODEPORT_ADDRESSES: tuple((net,) for net in nodeport_addresses(facts)),
        n.LOCAL_POD_CIDRS: tuple((net,) for net in pod_cidrs),
    }
    return TableDef(family, TABLE_SETS, elements, chains)
