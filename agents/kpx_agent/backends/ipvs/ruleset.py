"""The ipvs backend's helper nftables table: the masquerade and drop rules IPVS cannot express.

Pure text rendering. Every value rendered is typed data from the node-local model (IP, int,
validated networks and interface names), never raw cluster text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ...localnet import DetectLocalMode, NodeInfo, ProxySettings
from .kernel import TABLE
from .model import CLUSTER_IPS, DROP, FIREWALL, FIREWALL_ALLOW, HAIRPIN, MASQ_IPS, Element

NFT_FAMILY = {4: "ip", 6: "ip6"}
_ADDR = {4: "ipv4_addr", 6: "ipv6_addr"}


def _cluster_ip_masquerade(family: int, settings: ProxySettings, node: NodeInfo) -> str:
    """The rule marking traffic to cluster IPs for masquerade, as upstream's ipvs mode: all of
    it with masqueradeAll; else what is not from a local pod (detectLocal); with nothing to
    tell local pods apart, only what the node sends from a Service IP (the source address the
    node picks for a cluster IP bound on kube-ipvs0 is that IP itself)."""
    fam = NFT_FAMILY[family]
    mark = f"meta mark set meta mark | 0x{settings.masquerade_mark:x}"
    lookup = f"{fam} daddr . meta l4proto . th dport @{CLUSTER_IPS}"
    if settings.masquerade_all:
        return f"{lookup} {mark}"
    detect = settings.detect_local
    if detect.mode is DetectLocalMode.BRIDGE_INTERFACE:
        return f'{lookup} iifname != "{detect.interface}" {mark}'
    if detect.mode is DetectLocalMode.INTERFACE_NAME_PREFIX:
        return f'{lookup} iifname != "{detect.interface}*" {mark}'
    networks = settings.cluster_cidrs
    if detect.mode is DetectLocalMode.NODE_CIDR:
        networks = node.pod_cidrs
    mine = [str(n) for n in networks if n.version == family]
    if not mine:
        return f"{fam} saddr . meta l4proto . th dport @{CLUSTER_IPS} {mark}"
    return f"{lookup} {fam} saddr != {{ {', '.join(mine)} }} {mark}"


def element_text(element: Element) -> str:
    family, *fields = element
    del family
    return " . ".join(str(f) for f in fields)


def base_table(family: int, settings: ProxySettings, node: NodeInfo,
               elements: Mapping[str, Iterable[Element]]) -> str:  # fmt: skip
    fam, addr = NFT_FAMILY[family], _ADDR[family]
    mark = f"0x{settings.masquerade_mark:x}"
    key = f"{addr} . inet_proto . inet_service"
    lines = [
        f"table {fam} {TABLE} {{}}",
        f"delete table {fam} {TABLE}",
        f"table {fam} {TABLE} {{",
        '  comment "kpx ipvs mode: masquerade and drops IPVS cannot express"',
        f"  set {CLUSTER_IPS} {{ type {key}; }}",
        f"  set {MASQ_IPS} {{ type {key}; }}",
        f"  set {HAIRPIN} {{ type {key} . {addr}; }}",
        f"  set {DROP} {{ type {key}; }}",
        f"  set {FIREWALL} {{ type {key}; }}",
        f"  set {FIREWALL_ALLOW} {{ type {key} . {addr}; flags interval; }}",
        "  chain services {",
        f"    {_cluster_ip_masquerade(family, settings, node)}",
        f"    {fam} daddr . meta l4proto . th dport @{MASQ_IPS} meta mark set meta mark | {mark}",
        "  }",
        "  chain prerouting {",
        "    type nat hook prerouting priority -100; policy accept;",
        "    jump services",
        "  }",
        "  chain output {",
        "    type nat hook output priority -100; policy accept;",
        "    jump services",
        "  }",
        "  chain postrouting {",
        "    type nat hook postrouting priority 100; policy accept;",
        f"    meta mark & {mark} == {mark} masquerade",
        f"    {fam} daddr . meta l4proto . th dport . {fam} saddr @{HAIRPIN} masquerade",
        "  }",
        # IPVS takes packets at LOCAL_IN (priority 98) and LOCAL_OUT (-99): run before it.
        "  chain filter-input {",
        "    type filter hook input priority -110; policy accept;",
        f"    {fam} daddr . meta l4proto . th dport @{DROP} drop",
        f"    {fam} daddr . meta l4proto . th dport @{FIREWALL} "
        f"{fam} daddr . meta l4proto . th dport . {fam} saddr != @{FIREWALL_ALLOW} drop",
        "  }",
        "  chain filter-output {",
        "    type filter hook output priority -110; policy accept;",
        f"    {fam} daddr . meta l4proto . th dport @{DROP} drop",
        f"    {fam} daddr . meta l4proto . th dport @{FIREWALL} "
        f"{fam} daddr . meta l4proto . th dport . {fam} saddr != @{FIREWALL_ALLOW} drop",
        "  }",
        "}",
    ]
    lines += element_lines("add", family, elements)
    return "\n".join(lines) + "\n"


def element_lines(verb: str, family: int, elements: Mapping[str, Iterable[Element]]) -> list[str]:
    fam = NFT_FAMILY[family]
    out = []
    for set_name, members in elements.items():
        texts = [element_text(e) for e in members if e[0] == family]
        for start in range(0, len(texts), 1000):
            chunk = ", ".join(texts[start : start + 1000])
            out.append(f"{verb} element {fam} {TABLE} {set_name} {{ {chunk} }}")
    return out
