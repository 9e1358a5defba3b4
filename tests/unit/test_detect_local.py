"""detectLocal, decided once (kpx_agent.model.detect_local) and rendered by every backend (nftables,
iptables, the ipvs helper table): each mode's match, the no-op detector, and the settings the
agent derives from its configuration file."""

from __future__ import annotations

import dataclasses
from ipaddress import ip_network

import pytest
from backend_samples import NODE, SETTINGS, sample_state

from kpx_agent.backends.iptables import names as ipt
from kpx_agent.backends.iptables.rules import port_rules
from kpx_agent.backends.ipvs import ruleset as ipvs_ruleset
from kpx_agent.backends.kernel.names import NFT_TABLE
from kpx_agent.backends.kernel.nft_transaction import table_text
from kpx_agent.backends.nftables.ruleset import base_table
from kpx_agent.model.detect_local import NOTHING_LOCAL, LocalPods, local_pods
from kpx_agent.model.service_ports import node_facts
from kpx_agent.model.types import DataplaneSettings, DetectLocal, DetectLocalMode, NodeInfo
from kpx_agent.settings import load, resolve

POD_CIDRS = (ip_network("10.244.1.0/24"), ip_network("fd00:244:1::/64"))
NODE_WITH_CIDRS = dataclasses.replace(NODE, pod_cidrs=POD_CIDRS)


def settings(mode: DetectLocalMode, interface: str = "") -> DataplaneSettings:
    return dataclasses.replace(SETTINGS, detect_local=DetectLocal(mode, interface))


# (settings, node, family) -> LocalPods; then the nft "not local" masquerade and the iptables
# SVC-chain rule and EXT short-circuit rule each backend renders from it.
CASES = [
    pytest.param(
        settings(DetectLocalMode.CLUSTER_CIDR),
        NODE,
        4,
        LocalPods(networks=(ip_network("10.244.0.0/16"),)),
        "ip saddr != 10.244.0.0/16",
        "! -s 10.244.0.0/16",
        "-s 10.244.0.0/16",
        id="ClusterCIDR",
    ),
    pytest.param(
        settings(DetectLocalMode.NODE_CIDR),
        NODE_WITH_CIDRS,
        4,
        LocalPods(networks=(ip_network("10.244.1.0/24"),)),
        "ip saddr != 10.244.1.0/24",
        "! -s 10.244.1.0/24",
        "-s 10.244.1.0/24",
        id="NodeCIDR",
    ),
    pytest.param(
        settings(DetectLocalMode.BRIDGE_INTERFACE, "cbr0"),
        NODE,
        4,
        LocalPods(interface="cbr0"),
        'iifname != "cbr0"',
        "! -i cbr0",
        "-i cbr0",
        id="BridgeInterface",
    ),
    pytest.param(
        settings(DetectLocalMode.INTERFACE_NAME_PREFIX, "veth"),
        NODE,
        4,
        LocalPods(interface_prefix="veth"),
        'iifname != "veth*"',
        "! -i veth+",
        "-i veth+",
        id="InterfaceNamePrefix",
    ),
]


@pytest.mark.parametrize(("cfg", "node", "family", "local", "nft", "ipt_not", "ipt_is"), CASES)
def test_each_mode_renders_its_match_in_both_backends(
    cfg: DataplaneSettings,
    node: NodeInfo,
    family: int,
    local: LocalPods,
    nft: str,
    ipt_not: str,
    ipt_is: str,
) -> None:
    assert local_pods(cfg, node, family) == local
    table = table_text(base_table(cfg, node_facts(cfg, node)[family]), NFT_TABLE)
    assert f"@cluster-ips {nft} meta mark set" in table
    # The short circuit of traffic from local pods, first among the short-circuit rules.
    assert f"{nft.replace('!= ', '')} ip daddr . meta l4proto . th dport vmap" in table
    local_etp = next(sp for sp in sample_state().services.values() if sp.key.name == "local")
    rules = port_rules(local_etp, cfg, local)
    svc = rules.own[("nat", ipt.svc_chain(local_etp.key))]
    ext = rules.own[("nat", ipt.ext_chain(local_etp.key))]
    assert svc[0].text == f"{ipt_not} -j KPX-MARK-MASQ"
    assert ext[0].text == f"{ipt_is} -j {ipt.svc_chain(local_etp.key)}"
    # The ipvs helper table: the same match (networks as a set), from the same facts.
    helper = ipvs_ruleset.base_table(cfg, node_facts(cfg, node)[family], {})
    prefix = "ip saddr != "
    ipvs = f"{prefix}{{ {nft.removeprefix(prefix)} }}" if nft.startswith(prefix) else nft
    assert f"@cluster-ips {ipvs} meta mark set" in helper


def test_node_cidr_is_the_first_pod_cidr_of_the_family_in_every_mode() -> None:
    """A Node listing two pod CIDRs of one family: upstream kube-proxy (getLocalDetectors,
    shared by its iptables, ipvs and nftables modes) takes the first of each family, and so
    does every kpx mode (the ipvs helper table once matched every one of them)."""
    cfg = settings(DetectLocalMode.NODE_CIDR)
    first, second = ip_network("10.244.1.0/24"), ip_network("10.244.2.0/24")
    node = dataclasses.replace(NODE, pod_cidrs=(first, second, ip_network("fd00:244:1::/64")))
    facts = node_facts(cfg, node)
    assert facts[4].local_pods.networks == (first,)
    nft = table_text(base_table(cfg, facts[4]), NFT_TABLE)
    helper = ipvs_ruleset.base_table(cfg, facts[4], {})
    local_etp = next(sp for sp in sample_state().services.values() if sp.key.name == "local")
    svc = port_rules(local_etp, cfg, facts[4].local_pods).own[("nat", ipt.svc_chain(local_etp.key))]
    assert f"ip saddr != {first} meta mark set" in nft
    assert f"ip saddr != {{ {first} }} meta mark set" in helper
    assert svc[0].text == f"! -s {first} -j KPX-MARK-MASQ"
    assert not any(str(second) in text for text in (nft, helper, svc[0].text))
    v6 = ipvs_ruleset.base_table(cfg, facts[6], {})
    assert "ip6 saddr != { fd00:244:1::/64 } meta mark set" in v6


@pytest.mark.parametrize(
    ("cfg", "node"),
    [
        (settings(DetectLocalMode.NODE_CIDR), NODE),  # the Node has no podCIDRs yet
        (dataclasses.replace(SETTINGS, cluster_cidrs=()), NODE),  # ClusterCIDR without CIDRs
    ],
    ids=["NodeCIDR-before-podCIDRs", "ClusterCIDR-without-CIDRs"],
)
def test_nothing_to_match_means_nothing_is_local(cfg: DataplaneSettings, node: NodeInfo) -> None:
    """Upstream's no-op detector: no off-cluster masquerade, no pod short circuit; traffic
    from the node itself is still short-circuited (and masqueraded)."""
    assert local_pods(cfg, node, 4) is NOTHING_LOCAL
    table = table_text(base_table(cfg, node_facts(cfg, node)[4]), NFT_TABLE)
    assert "saddr" not in table.split("chain services {")[1].split("}")[0].replace("fib saddr", "")
    assert "fib saddr type local ip daddr . meta l4proto . th dport vmap @short-circuit" in table
    # ipvs: only what the node sends from a Service IP (upstream's ipvs fallback).
    helper = ipvs_ruleset.base_table(cfg, node_facts(cfg, node)[4], {})
    assert "ip saddr . meta l4proto . th dport @cluster-ips meta mark set" in helper
    local_etp = next(sp for sp in sample_state().services.values() if sp.key.name == "local")
    rules = port_rules(local_etp, cfg, NOTHING_LOCAL)
    assert rules.own[("nat", ipt.svc_chain(local_etp.key))][0].text.startswith("-m statistic")
    assert [r.text for r in rules.own[("nat", ipt.ext_chain(local_etp.key))]] == [
        "-m addrtype --src-type LOCAL -j KPX-MARK-MASQ",
        f"-m addrtype --src-type LOCAL -j {ipt.svc_chain(local_etp.key)}",
    ]


def test_a_node_cidr_change_changes_the_match() -> None:
    cfg = settings(DetectLocalMode.NODE_CIDR)
    other = dataclasses.replace(NODE, pod_cidrs=(ip_network("10.244.9.0/24"),))
    assert local_pods(cfg, other, 4).networks == (ip_network("10.244.9.0/24"),)
    assert other != NODE_WITH_CIDRS  # a Node change: the backends' next sync is a full one


def test_interface_names_are_checked_again_before_rendering() -> None:
    with pytest.raises(ValueError):
        DetectLocal(DetectLocalMode.BRIDGE_INTERFACE, 'cbr0" accept')
    with pytest.raises(ValueError):
        DetectLocal(DetectLocalMode.INTERFACE_NAME_PREFIX, "")
    with pytest.raises(ValueError):
        DetectLocal(DetectLocalMode.CLUSTER_CIDR, "cbr0")


def test_the_agent_settings_carry_detect_local_and_localhost_node_ports() -> None:
    def resolved(mode: str, **overrides: object) -> DataplaneSettings:
        return resolve(load(mode, None, overrides or None)).proxy

    assert resolved("nftables").detect_local == DetectLocal()
    prefix = {"mode": "InterfaceNamePrefix", "interfaceNamePrefix": "cali"}
    assert resolved("nftables", detectLocal=prefix).detect_local == DetectLocal(
        DetectLocalMode.INTERFACE_NAME_PREFIX, "cali"
    )
    bridge = {"mode": "BridgeInterface", "bridgeInterface": "cbr0"}
    assert resolved("iptables", detectLocal=bridge).detect_local.interface == "cbr0"
    # localhostNodePorts: iptables by default, nftables as its opt-in, and only where 127.0.0.1
    # can be a NodePort address.
    assert resolved("iptables").localhost_node_ports
    assert not resolved("nftables").localhost_node_ports
    opt_in = {"localhostNodePorts": True}
    assert resolved("nftables", nftables=opt_in).localhost_node_ports
    assert not resolved(
        "nftables", nftables=opt_in, nodePortAddresses=["primary"]
    ).localhost_node_ports
    assert resolved(
        "nftables", nftables=opt_in, nodePortAddresses=["127.0.0.0/8"]
    ).localhost_node_ports
    off = {"masqueradeBit": 14, "localhostNodePorts": False}
    assert not resolved("iptables", iptables=off).localhost_node_ports
    assert not resolved("iptables", nodePortAddresses=["primary"]).localhost_node_ports
    assert not resolved("iptables", nodePortAddresses=["10.0.0.0/8"]).localhost_node_ports
    assert resolved("iptables", nodePortAddresses=["127.0.0.0/8"]).localhost_node_ports
    liberal = {"tcpBeLiberal": True}
    assert resolved("iptables", conntrack=liberal).conntrack_tcp_be_liberal
