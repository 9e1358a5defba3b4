"""Pure rendering of the iptables rules: the fixed chains and what each service port adds.

A service port owns whole chains (KPX-SVC-, KPX-EXT-, KPX-FW-<hash>) and contributes rules to
the shared chains (KPX-SERVICES, KPX-NODEPORTS, KPX-HAIRPIN in nat; KPX-FIREWALL, KPX-REJECT,
KPX-NODEPORTS-REJECT in filter). Rules are typed values (`rule.Rule`: matches and a target),
keyed by the chain they go in; nothing here writes iptables syntax or does I/O.

Every match and target holds parsed values (addresses, networks, enums, ints) and the names
in `names.py`; nothing from the cluster is pasted in as it came. The only cluster strings
that reach a rule are the service port's own name in a comment, and only when it is made of
characters that need no quoting (otherwise the comment is left out).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from ipaddress import ip_network

from ...model.types import (
    DataplaneSettings,
    Endpoint,
    LocalPods,
    NodeFacts,
    ServicePort,
    ServicePortKey,
)
from . import names as n
from .rule import (
    AddrType,
    Comment,
    CtState,
    Destination,
    DestinationPort,
    Dnat,
    InInterface,
    Mark,
    MarkOr,
    MarkXor,
    Masquerade,
    Match,
    Random,
    Recent,
    Rule,
    Source,
    Verdict,
    jump,
    probability_text,
    proto,
    rule,
)

log = logging.getLogger(__name__)

ChainId = tuple[str, str]  # (table, chain)
Rules = tuple[Rule, ...]  # in order
Lines = tuple[str, ...]  # the same rules as written: each body after `-A CHAIN `

# Chains every service port may add rules to; each is rendered as head + owners' rules + tail.
SHARED_CHAINS: tuple[ChainId, ...] = (
    (n.NAT, n.SERVICES),
    (n.NAT, n.NODEPORTS),
    (n.NAT, n.HAIRPIN),
    (n.FILTER, n.FIREWALL),
    (n.FILTER, n.REJECT),
    (n.FILTER, n.NODEPORTS_REJECT),
)

_SAFE_COMMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,200}")
MARK_MASQ = jump(n.MARK_MASQ)
SOURCE_LOCAL: tuple[Match, ...] = (AddrType.SOURCE_LOCAL,)


@dataclass(frozen=True, slots=True)
class PortRules:
    """Everything one service port puts into one family's tables."""

    own: Mapping[ChainId, Rules] = field(default_factory=dict)  # whole chains it owns
    shared: Mapping[ChainId, Rules] = field(default_factory=dict)  # its rules in shared chains

    def lines(self) -> PortLines:
        """The same, as written (what the backend records)."""
        return PortLines(
            {cid: lines(rules) for cid, rules in self.own.items()},
            {cid: lines(rules) for cid, rules in self.shared.items()},
        )


@dataclass(frozen=True, slots=True)
class PortLines:
    """A service port's rules as written: what the backend's record (`ChainBook`) keeps, so
    that the record is the text the kernel was given, and the typed rules of a sync are
    freed as soon as they are written (a full sync at 10,000 Services makes about 100,000:
    kept, the cyclic collector would walk them all at every pass)."""

    own: Mapping[ChainId, Lines] = field(default_factory=dict)
    shared: Mapping[ChainId, Lines] = field(default_factory=dict)


def lines(rules: Rules) -> Lines:
    return tuple([r.text for r in rules])


def chain_lines(chains: Mapping[ChainId, Rules]) -> dict[ChainId, Lines]:
    return {cid: lines(rules) for cid, rules in chains.items()}


def _comment(key: ServicePortKey) -> tuple[Match, ...]:
    text = str(key)
    return (Comment(text),) if _SAFE_COMMENT.fullmatch(text) else ()


def probability(i: int, count: int) -> str:
    """Upstream's cascade: rule i of `count` matches 1/(count-i) of what reaches it."""
    return probability_text(_chance(count - i).probability)


@cache
def _chance(left: int) -> Random:
    """The match of one in `left` (rules many service ports share, made once)."""
    return Random(1.0 / left)


def _interface(local: LocalPods) -> str:
    """The validated interface name, or the prefix as iptables writes one (`veth+`)."""
    return local.interface or f"{local.interface_prefix}+"


def if_local(local: LocalPods) -> list[tuple[Match, ...]]:
    """Matches of traffic from this node's pods: one rule per match; none when the
    detectLocal mode has nothing to match (then nothing counts as local)."""
    if local.networks:
        return [(Source(net),) for net in local.networks]
    if local.implemented:
        return [(InInterface(_interface(local)),)]
    return []


def _masquerade_off_cluster(
    sp: ServicePort, settings: DataplaneSettings, local: LocalPods
) -> list[Rule]:
    """The SVC chain's first rules: mark what must be masqueraded. With masqueradeAll, only
    traffic to the cluster IPs (not what the short circuit sends here, as upstream)."""
    if settings.masquerade_all:
        return [rule(Destination(ip), target=MARK_MASQ) for ip in sp.cluster_ips]
    if len(local.networks) > 1:
        return [rule(target=jump(n.OFF_CLUSTER))]
    if local.networks:
        return [rule(Source(local.networks[0], negate=True), target=MARK_MASQ)]
    if local.implemented:
        return [rule(InInterface(_interface(local), negate=True), target=MARK_MASQ)]
    return []


def _pick(sp: ServicePort, eps: tuple[Endpoint, ...]) -> list[Rule]:
    """Affinity checks (if any), then the random cascade; each rule DNATs to its endpoint.

    There is no chain per endpoint (upstream's KUBE-SEP-): iptables-nft loads chains slowly
    (see README.md), so each endpoint is a rule. A local endpoint's hairpin masquerade is in
    KPX-HAIRPIN instead, and an affinity hit refreshes its entry (`--update`) as upstream's
    `--set` in KUBE-SEP does.
    """
    is_proto, affinity = proto(sp.protocol), sp.affinity_timeout
    rules = []
    if affinity > 0:
        for ep in eps:
            recent = Recent(n.affinity_list(sp.key, ep), affinity)
            rules.append(Rule((is_proto, recent), Dnat(ep.ip, ep.port)))
    count = len(eps)
    last = count - 1
    for i, ep in enumerate(eps):
        matches: tuple[Match, ...] = (_chance(count - i), is_proto) if i < last else (is_proto,)
        if affinity > 0:
            matches = (*matches, Recent(n.affinity_list(sp.key, ep)))
        rules.append(Rule(matches, Dnat(ep.ip, ep.port)))
    return rules


def port_rules(sp: ServicePort, settings: DataplaneSettings, local: LocalPods) -> PortRules:
    """The chains and shared-chain rules of one service port (in its own family); `local`
    is the family's detectLocal match. The model checked every port, address and family
    (a ServicePort holds only valid ports, and addresses of its own family)."""
    key = sp.key
    node_port = sp.node_port
    cluster_ips, external_ips, lb_ips = sp.cluster_ips, sp.external_ips, sp.load_balancer_ips
    cluster_eps = sp.cluster_endpoints
    external_eps = sp.external_endpoints
    short_eps = sp.short_circuit_endpoints
    has_external = bool(external_ips or lb_ips or node_port)
    use_svc = bool(cluster_ips and cluster_eps)
    # The EXT chain exists when external traffic has somewhere to go: its endpoints, or (with
    # externalTrafficPolicy Local) the short circuit for local pods and the node itself.
    use_ext = has_external and bool(external_eps or short_eps)
    # External traffic that is masqueraded anyway and goes to the same endpoints shares the
    # cluster chain (as upstream does); otherwise EXT picks among its own endpoints, so that
    # externalTrafficPolicy Local never meets the SVC chain's off-cluster masquerade.
    ext_via_svc = use_ext and sp.external_masquerade and external_eps == cluster_eps
    use_svc = use_svc or ext_via_svc
    # The short circuit goes to the SVC chain when it has the same endpoints (policy Cluster
    # for internal traffic), else to a KPX-SHORT chain of its own.
    short_via_svc = use_svc and short_eps == cluster_eps
    use_short = use_ext and bool(short_eps) and not short_via_svc
    fw_ranges = sp.load_balancer_source_ranges
    use_fw = use_ext and bool(lb_ips) and sp.load_balancer_firewall

    svc, ext, fw, short = n.port_chains(key)
    own: dict[ChainId, Rules] = {}
    used: list[Endpoint] = []
    if use_svc:
        rules = _masquerade_off_cluster(sp, settings, local)
        rules += _pick(sp, cluster_eps)
        own[(n.NAT, svc)] = tuple(rules)
        used += cluster_eps
    if use_short:
        own[(n.NAT, short)] = tuple(_pick(sp, short_eps))
        used += short_eps
    if use_ext:
        rules = []
        if sp.external_masquerade:
            rules.append(rule(target=MARK_MASQ))
        elif short_eps:
            # Upstream's short circuit: traffic from a local pod, or from the node itself
            # (masqueraded: its source is a node address), goes to every cluster endpoint.
            target = jump(svc if short_via_svc else short)
            rules += [Rule(m, target) for m in if_local(local)]
            rules.append(Rule(SOURCE_LOCAL, MARK_MASQ))
            rules.append(Rule(SOURCE_LOCAL, target))
        if ext_via_svc:
            rules.append(rule(target=jump(svc)))
        elif external_eps:
            rules += _pick(sp, external_eps)
            used += external_eps
        own[(n.NAT, ext)] = tuple(rules)
    if use_fw:
        to_ext = jump(ext)
        own[(n.NAT, fw)] = tuple(rule(Source(r), target=to_ext) for r in fw_ranges)
    # Hairpin: a local endpoint that reached itself through a VIP is marked for masquerade (in
    # POSTROUTING, after the DNAT), so that its reply comes back through the node. One rule per
    # address, however many ports use it.
    hairpin = tuple(
        rule(Source(ip), Destination(ip), target=MARK_MASQ)
        for ip in dict.fromkeys(ep.ip for ep in used if ep.local)
    )

    comment = _comment(key)
    match = DestinationPort(sp.protocol, sp.port)
    no_cluster = Verdict.DROP if sp.drop_when_no_cluster_endpoints else Verdict.REJECT
    no_external = Verdict.DROP if sp.drop_when_no_external_endpoints else Verdict.REJECT
    services: list[Rule] = []
    reject: list[Rule] = []
    for ip in cluster_ips:
        if cluster_eps:
            services.append(Rule((*comment, Destination(ip), match), jump(svc)))
        else:
            reject.append(Rule((*comment, Destination(ip), match), no_cluster))
    # Without external endpoints, what EXT did not short-circuit (DNAT) meets the reject or
    # drop in the filter table, still addressed to the external IP.
    for ip in external_ips:
        if use_ext:
            services.append(Rule((*comment, Destination(ip), match), jump(ext)))
        if not external_eps:
            reject.append(Rule((*comment, Destination(ip), match), no_external))
    firewall: list[Rule] = []
    for ip in lb_ips:
        if use_ext:
            services.append(Rule((*comment, Destination(ip), match), jump(fw if use_fw else ext)))
        if not external_eps:
            reject.append(Rule((*comment, Destination(ip), match), no_external))
        if sp.load_balancer_firewall:
            # Allowed sources were DNATed by KPX-FW (or meet KPX-REJECT when there are no
            # endpoints); whatever still has the load-balancer IP as destination is dropped.
            firewall += [
                Rule((*comment, Source(r), Destination(ip), match), Verdict.RETURN)
                for r in fw_ranges
            ]
            firewall.append(Rule((*comment, Destination(ip), match), Verdict.DROP))
    shared: dict[ChainId, Rules] = {}
    if hairpin:
        shared[(n.NAT, n.HAIRPIN)] = hairpin
    if services:
        shared[(n.NAT, n.SERVICES)] = tuple(services)
    if reject:
        shared[(n.FILTER, n.REJECT)] = tuple(reject)
    if firewall:
        shared[(n.FILTER, n.FIREWALL)] = tuple(firewall)
    if node_port:
        np_match = DestinationPort(sp.protocol, node_port)
        if use_ext:
            shared[(n.NAT, n.NODEPORTS)] = (Rule((*comment, np_match), jump(ext)),)
        if not external_eps:
            shared[(n.FILTER, n.NODEPORTS_REJECT)] = (Rule((*comment, np_match), no_external),)
    return PortRules(own=own, shared=shared)


_LOOPBACK = {4: ip_network("127.0.0.0/8"), 6: ip_network("::1/128")}
_DESTINATION_LOCAL = AddrType.DESTINATION_LOCAL


def nodeport_matches(facts: NodeFacts, settings: DataplaneSettings) -> list[tuple[Match, ...]]:
    """Destination matches for NodePorts (NodeFacts.nodeport_networks), loopback included
    only with localhost NodePorts (see `nodeport_guard` for configured networks)."""
    family, nets, localhost = facts.family, facts.nodeport_networks, facts.localhost_node_ports
    if nets is None:
        if localhost:
            return [(_DESTINATION_LOCAL,)]
        return [(Destination(_LOOPBACK[family], negate=True), _DESTINATION_LOCAL)]
    matches: list[tuple[Match, ...]] = [(Destination(net), _DESTINATION_LOCAL) for net in nets]
    if localhost and not settings.node_port_networks:
        # nodePortAddresses empty: the node's addresses, and localhost.
        matches.append((Destination(_LOOPBACK[4]), _DESTINATION_LOCAL))
    return matches


def nodeport_guard(facts: NodeFacts) -> list[Rule]:
    """Rules before the NodePort matches keeping loopback out of them where a configured
    network holds it but localhost NodePorts are off (IPv6 never has them)."""
    nets = facts.nodeport_networks or ()
    loopback = _LOOPBACK[facts.family]
    if facts.localhost_node_ports or not any(net.overlaps(loopback) for net in nets):
        return []
    return [rule(Destination(loopback), target=Verdict.RETURN)]


def fixed_chains(settings: DataplaneSettings, facts: NodeFacts) -> dict[ChainId, Rules]:
    """The chains that do not depend on any service port (only on the settings and node)."""
    mark = settings.masquerade_mark
    invalid = (
        ()
        if settings.conntrack_tcp_be_liberal
        else (rule(CtState(("INVALID",)), target=Verdict.DROP),)
    )
    chains: dict[ChainId, Rules] = {
        (n.NAT, n.MARK_MASQ): (rule(target=MarkOr(mark)),),
        (n.NAT, n.POSTROUTING): (
            rule(CtState(("DNAT",)), target=jump(n.HAIRPIN)),
            rule(Mark(mark, negate=True), target=Verdict.RETURN),
            rule(target=MarkXor(mark)),
            rule(target=Masquerade()),
        ),
        (n.FILTER, n.FILTER_CHAIN): (
            rule(target=jump(n.FIREWALL)),
            rule(target=jump(n.REJECT)),
            *nodeport_guard(facts),
            *(Rule(m, jump(n.NODEPORTS_REJECT)) for m in nodeport_matches(facts, settings)),
        ),
        # Upstream's KUBE-FORWARD: new connections meet KPX-FILTER first; then what we marked
        # for masquerade, and the rest of its connections, are accepted, so a FORWARD policy
        # of DROP does not stop NodePort traffic to other nodes' endpoints. Conntrack-INVALID
        # packets are dropped (unless conntrack.tcpBeLiberal), as upstream does.
        (n.FILTER, n.FORWARD): (
            rule(CtState(("NEW",)), target=jump(n.FILTER_CHAIN)),
            *invalid,
            rule(Mark(mark), target=Verdict.ACCEPT),
            rule(CtState(("RELATED", "ESTABLISHED")), target=Verdict.ACCEPT),
        ),
    }
    if facts.localhost_node_ports:
        # route_localnet=1 lets packets from anywhere reach 127.0.0.0/8: drop those that did
        # not come from loopback and are not replies or DNATed NodePort traffic (upstream's
        # rule, https://issue.k8s.io/90259).
        loopback = _LOOPBACK[4]
        chains[(n.FILTER, n.LOCALNET)] = (
            rule(
                Destination(loopback),
                Source(loopback, negate=True),
                CtState(("RELATED", "ESTABLISHED", "DNAT"), negate=True),
                target=Verdict.DROP,
            ),
        )
    local = facts.local_pods
    if not settings.masquerade_all and len(local.networks) > 1:
        chains[(n.NAT, n.OFF_CLUSTER)] = (
            *(rule(Source(c), target=Verdict.RETURN) for c in local.networks),
            rule(target=MARK_MASQ),
        )
    return chains


def shared_frames(
    settings: DataplaneSettings, facts: NodeFacts
) -> dict[ChainId, tuple[Rules, Rules]]:
    """(head, tail) of each shared chain; the service ports' rules go in between."""
    frames: dict[ChainId, tuple[Rules, Rules]] = {cid: ((), ()) for cid in SHARED_CHAINS}
    frames[(n.NAT, n.SERVICES)] = (
        (),
        (
            *nodeport_guard(facts),
            *(Rule(m, jump(n.NODEPORTS)) for m in nodeport_matches(facts, settings)),
        ),
    )
    return frames
