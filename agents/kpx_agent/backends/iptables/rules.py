"""Pure rendering of the iptables rules: the fixed chains and what each service port adds.

A service port owns whole chains (KPX-SVC-, KPX-EXT-, KPX-FW-<hash>) and contributes rules to
the shared chains (KPX-SERVICES, KPX-NODEPORTS, KPX-HAIRPIN in nat; KPX-FIREWALL, KPX-REJECT,
KPX-NODEPORTS-REJECT in filter). Rules are rule bodies, the text after
`-A CHAIN `; nothing here does I/O.

All text is formatted from parsed values (ipaddress objects, enums, ints) and the names in
`names.py`; nothing from the cluster is pasted in as it came. The only cluster strings that
reach a rule are the service port's own name in a comment, and only when it is made of
characters that need no quoting (otherwise the comment is left out).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import ip_network

from ...localnet import (
    Endpoint,
    IPAddress,
    IPNetwork,
    LocalPods,
    NodeFacts,
    ProxySettings,
    ServicePort,
    ServicePortKey,
)
from . import names as n

log = logging.getLogger(__name__)

ChainId = tuple[str, str]  # (table, chain)
Rules = tuple[str, ...]  # rule bodies, in order

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


@dataclass(frozen=True, slots=True)
class PortRules:
    """Everything one service port puts into one family's tables."""

    own: Mapping[ChainId, Rules] = field(default_factory=dict)  # whole chains it owns
    shared: Mapping[ChainId, Rules] = field(default_factory=dict)  # its rules in shared chains


def _host(ip: IPAddress) -> str:
    return f"{ip}/{ip.max_prefixlen}"


def _net(net: IPNetwork) -> str:
    return str(net)


def _destination(ep: Endpoint) -> str:
    return f"[{ep.ip}]:{ep.port}" if ep.ip.version == 6 else f"{ep.ip}:{ep.port}"


def _comment(key: ServicePortKey) -> str:
    text = str(key)
    return f'-m comment --comment "{text}" ' if _SAFE_COMMENT.fullmatch(text) else ""


def probability(i: int, count: int) -> str:
    """Upstream's cascade: rule i of `count` matches 1/(count-i) of what reaches it."""
    return f"{1.0 / (count - i):0.10f}"


def _interface(local: LocalPods) -> str:
    """The validated interface name, or the prefix as iptables writes one (`veth+`)."""
    return local.interface or f"{local.interface_prefix}+"


def if_local(local: LocalPods) -> list[str]:
    """Matches (rule prefixes) of traffic from this node's pods: one rule per match; none
    when the detectLocal mode has nothing to match (then nothing counts as local)."""
    if local.networks:
        return [f"-s {_net(net)} " for net in local.networks]
    if local.implemented:
        return [f"-i {_interface(local)} "]
    return []


def _masquerade_off_cluster(
    sp: ServicePort, settings: ProxySettings, local: LocalPods
) -> list[str]:
    """The SVC chain's first rules: mark what must be masqueraded. With masqueradeAll, only
    traffic to the cluster IPs (not what the short circuit sends here, as upstream)."""
    if settings.masquerade_all:
        return [f"-d {_host(ip)} -j {n.MARK_MASQ}" for ip in sp.cluster_ips]
    if len(local.networks) > 1:
        return [f"-j {n.OFF_CLUSTER}"]
    if local.networks:
        return [f"! -s {_net(local.networks[0])} -j {n.MARK_MASQ}"]
    if local.implemented:
        return [f"! -i {_interface(local)} -j {n.MARK_MASQ}"]
    return []


def _pick(sp: ServicePort, eps: tuple[Endpoint, ...]) -> list[str]:
    """Affinity checks (if any), then the random cascade; each rule DNATs to its endpoint.

    There is no chain per endpoint (upstream's KUBE-SEP-): iptables-nft loads chains slowly
    (see README.md), so each endpoint is a rule. A local endpoint's hairpin masquerade is in
    KPX-HAIRPIN instead, and an affinity hit refreshes its entry (`--update`) as upstream's
    `--set` in KUBE-SEP does.
    """
    proto, affinity = sp.protocol.value, sp.affinity_timeout
    rules = []
    if affinity > 0:
        for ep in eps:
            name = n.affinity_list(sp.key, ep)
            rules.append(
                f"-p {proto} -m recent --name {name} --update --seconds {affinity} --reap"
                f" -j DNAT --to-destination {_destination(ep)}"
            )
    count = len(eps)
    for i, ep in enumerate(eps):
        chance = (
            f"-m statistic --mode random --probability {probability(i, count)} "
            if i < count - 1
            else ""
        )
        remember = f"-m recent --name {n.affinity_list(sp.key, ep)} --set " if affinity > 0 else ""
        rules.append(f"{chance}-p {proto} {remember}-j DNAT --to-destination {_destination(ep)}")
    return rules


def port_rules(sp: ServicePort, settings: ProxySettings, local: LocalPods) -> PortRules:
    """The chains and shared-chain rules of one service port (in its own family); `local`
    is the family's detectLocal match. The model checked every port, address and family
    (a ServicePort holds only valid ports, and addresses of its own family)."""
    key, proto = sp.key, sp.protocol.value
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
    use_fw = use_ext and bool(lb_ips) and bool(sp.load_balancer_source_ranges)

    svc, ext, fw = n.svc_chain(key), n.ext_chain(key), n.fw_chain(key)
    short = n.short_chain(key)
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
            rules.append(f"-j {n.MARK_MASQ}")
        elif short_eps:
            # Upstream's short circuit: traffic from a local pod, or from the node itself
            # (masqueraded: its source is a node address), goes to every cluster endpoint.
            target = svc if short_via_svc else short
            rules += [f"{m}-j {target}" for m in if_local(local)]
            rules.append(f"-m addrtype --src-type LOCAL -j {n.MARK_MASQ}")
            rules.append(f"-m addrtype --src-type LOCAL -j {target}")
        if ext_via_svc:
            rules.append(f"-j {svc}")
        elif external_eps:
            rules += _pick(sp, external_eps)
            used += external_eps
        own[(n.NAT, ext)] = tuple(rules)
    if use_fw:
        own[(n.NAT, fw)] = tuple(f"-s {_net(r)} -j {ext}" for r in fw_ranges)
    # Hairpin: a local endpoint that reached itself through a VIP is marked for masquerade (in
    # POSTROUTING, after the DNAT), so that its reply comes back through the node. One rule per
    # address, however many ports use it.
    hairpin = tuple(
        dict.fromkeys(
            f"-s {_host(ep.ip)} -d {_host(ep.ip)} -j {n.MARK_MASQ}" for ep in used if ep.local
        )
    )

    comment = _comment(key)
    match = f"-p {proto} -m {proto} --dport {sp.port}"
    no_cluster = "DROP" if sp.drop_when_no_cluster_endpoints else "REJECT"
    no_external = "DROP" if sp.drop_when_no_external_endpoints else "REJECT"
    services: list[str] = []
    reject: list[str] = []
    for ip in cluster_ips:
        if cluster_eps:
            services.append(f"{comment}-d {_host(ip)} {match} -j {svc}")
        else:
            reject.append(f"{comment}-d {_host(ip)} {match} -j {no_cluster}")
    # Without external endpoints, what EXT did not short-circuit (DNAT) meets the reject or
    # drop in the filter table, still addressed to the external IP.
    for ip in external_ips:
        if use_ext:
            services.append(f"{comment}-d {_host(ip)} {match} -j {ext}")
        if not external_eps:
            reject.append(f"{comment}-d {_host(ip)} {match} -j {no_external}")
    firewall: list[str] = []
    for ip in lb_ips:
        if use_ext:
            services.append(f"{comment}-d {_host(ip)} {match} -j {fw if use_fw else ext}")
        if not external_eps:
            reject.append(f"{comment}-d {_host(ip)} {match} -j {no_external}")
        if sp.load_balancer_source_ranges:
            # Allowed sources were DNATed by KPX-FW (or meet KPX-REJECT when there are no
            # endpoints); whatever still has the load-balancer IP as destination is dropped.
            firewall += [
                f"{comment}-s {_net(r)} -d {_host(ip)} {match} -j RETURN" for r in fw_ranges
            ]
            firewall.append(f"{comment}-d {_host(ip)} {match} -j DROP")
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
        np_match = f"-p {proto} -m {proto} --dport {node_port}"
        if use_ext:
            shared[(n.NAT, n.NODEPORTS)] = (f"{comment}{np_match} -j {ext}",)
        if not external_eps:
            shared[(n.FILTER, n.NODEPORTS_REJECT)] = (f"{comment}{np_match} -j {no_external}",)
    return PortRules(own=own, shared=shared)


_LOOPBACK = {4: ip_network("127.0.0.0/8"), 6: ip_network("::1/128")}


def nodeport_matches(facts: NodeFacts, settings: ProxySettings) -> list[str]:
    """Destination matches for NodePorts (NodeFacts.nodeport_networks), loopback included
    only with localhost NodePorts (see `nodeport_guard` for configured networks)."""
    family, nets, localhost = facts.family, facts.nodeport_networks, facts.localhost_node_ports
    if nets is None:
        if localhost:
            return ["-m addrtype --dst-type LOCAL "]
        return [f"! -d {_net(_LOOPBACK[family])} -m addrtype --dst-type LOCAL "]
    matches = [f"-d {_net(net)} -m addrtype --dst-type LOCAL " for net in nets]
    if localhost and not settings.node_port_networks:
        # nodePortAddresses empty: the node's addresses, and localhost.
        matches.append(f"-d {_net(_LOOPBACK[4])} -m addrtype --dst-type LOCAL ")
    return matches


def nodeport_guard(facts: NodeFacts) -> list[str]:
    """Rules before the NodePort matches keeping loopback out of them where a configured
    network holds it but localhost NodePorts are off (IPv6 never has them)."""
    nets = facts.nodeport_networks or ()
    loopback = _LOOPBACK[facts.family]
    if facts.localhost_node_ports or not any(net.overlaps(loopback) for net in nets):
        return []
    return [f"-d {_net(loopback)} -j RETURN"]


def fixed_chains(settings: ProxySettings, facts: NodeFacts) -> dict[ChainId, Rules]:
    """The chains that do not depend on any service port (only on the settings and node)."""
    mark = f"{settings.masquerade_mark:#x}"
    invalid = (
        () if settings.conntrack_tcp_be_liberal else ("-m conntrack --ctstate INVALID -j DROP",)
    )
    chains: dict[ChainId, Rules] = {
        (n.NAT, n.MARK_MASQ): (f"-j MARK --or-mark {mark}",),
        (n.NAT, n.POSTROUTING): (
            f"-m conntrack --ctstate DNAT -j {n.HAIRPIN}",
            f"-m mark ! --mark {mark}/{mark} -j RETURN",
            f"-j MARK --xor-mark {mark}",
            "-j MASQUERADE --random-fully",
        ),
        (n.FILTER, n.FILTER_CHAIN): (
            f"-j {n.FIREWALL}",
            f"-j {n.REJECT}",
            *nodeport_guard(facts),
            *(f"{m}-j {n.NODEPORTS_REJECT}" for m in nodeport_matches(facts, settings)),
        ),
        # Upstream's KUBE-FORWARD: new connections meet KPX-FILTER first; then what we marked
        # for masquerade, and the rest of its connections, are accepted, so a FORWARD policy
        # of DROP does not stop NodePort traffic to other nodes' endpoints. Conntrack-INVALID
        # packets are dropped (unless conntrack.tcpBeLiberal), as upstream does.
        (n.FILTER, n.FORWARD): (
            f"-m conntrack --ctstate NEW -j {n.FILTER_CHAIN}",
            *invalid,
            f"-m mark --mark {mark}/{mark} -j ACCEPT",
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        ),
    }
    if facts.localhost_node_ports:
        # route_localnet=1 lets packets from anywhere reach 127.0.0.0/8: drop those that did
        # not come from loopback and are not replies or DNATed NodePort traffic (upstream's
        # rule, https://issue.k8s.io/90259).
        chains[(n.FILTER, n.LOCALNET)] = (
            "-d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT"
            " -j DROP",
        )
    local = facts.local_pods
    if not settings.masquerade_all and len(local.networks) > 1:
        chains[(n.NAT, n.OFF_CLUSTER)] = (
            *(f"-s {_net(c)} -j RETURN" for c in local.networks),
            f"-j {n.MARK_MASQ}",
        )
    return chains


def shared_frames(settings: ProxySettings, facts: NodeFacts) -> dict[ChainId, tuple[Rules, Rules]]:
    """(head, tail) of each shared chain; the service ports' rules go in between."""
    frames: dict[ChainId, tuple[Rules, Rules]] = {cid: ((), ()) for cid in SHARED_CHAINS}
    frames[(n.NAT, n.SERVICES)] = (
        (),
        (
            *nodeport_guard(facts),
            *(f"{m}-j {n.NODEPORTS}" for m in nodeport_matches(facts, settings)),
        ),
    )
    return frames
