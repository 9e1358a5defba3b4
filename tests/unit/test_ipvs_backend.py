"""The ipvs backend's pure parts and its delta logic, against a recording fake of IPVS.

The kernel side (real virtual servers, real packets) is tests/e2e/test_ipvs_kernel.py, which
runs in a proxy-vm guest (tests/e2e/test_ipvs_in_vm.py).
"""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest

from kpx_agent import settings as settings_mod
from kpx_agent.backends.ipvs import backend as backend_mod
from kpx_agent.backends.ipvs.backend import IpvsBackend
from kpx_agent.backends.ipvs.fake import FakeKernel
from kpx_agent.backends.ipvs.model import (
    CLUSTER_IPS,
    DROP,
    FIREWALL,
    FIREWALL_ALLOW,
    MASQ_IPS,
    VirtualKey,
    VirtualServer,
    allowed_elements,
    plan_port,
)
from kpx_agent.backends.ipvs.ruleset import base_table
from kpx_agent.model.service_ports import local_state, node_facts
from kpx_agent.model.types import (
    IP,
    DataplaneSettings,
    DetectLocal,
    DetectLocalMode,
    Endpoint,
    IPVSOptions,
    NodeInfo,
    NodeLocalState,
    Protocol,
    ServicePort,
    ServicePortKey,
)

NODE = NodeInfo("n1", (IP.of("192.168.0.1"), IP.of("10.1.0.1")))
SETTINGS = DataplaneSettings(cluster_cidrs=(ip_network("10.244.0.0/16"),))
E1 = Endpoint(IP.of("10.244.1.2"), 8080, True)
E2 = Endpoint(IP.of("10.244.2.2"), 8080)


def key(name: str, proto: Protocol = Protocol.TCP) -> ServicePortKey:
    return ServicePortKey("d", name, "", proto, 4)


def web(*eps: Endpoint, **extra: Any) -> ServicePort:
    return ServicePort(
        key("web"),
        80,
        cluster_ips=(IP.of("10.96.0.10"),),
        node_port=30080,
        cluster_endpoints=eps,
        external_endpoints=eps,
        **extra,
    )


def test_a_service_port_becomes_virtual_servers_addresses_and_set_elements() -> None:
    plan = plan_port(web(E1, E2, affinity_timeout=600), NODE, SETTINGS)
    vip = VirtualKey(4, "tcp", "10.96.0.10", 80)
    assert set(plan.virtual_servers) == {
        vip,
        VirtualKey(4, "tcp", "192.168.0.1", 30080),
        VirtualKey(4, "tcp", "10.1.0.1", 30080),
    }
    assert plan.virtual_servers[vip] == VirtualServer(
        vip, "rr", 600, frozenset({("10.244.1.2", 8080), ("10.244.2.2", 8080)})
    )
    assert plan.bound == {(4, "10.96.0.10")}  # node addresses are already the node's
    assert plan.elements[CLUSTER_IPS] == {(4, "10.96.0.10", "tcp", 80)}
    assert (4, "192.168.0.1", "tcp", 30080) in plan.elements[MASQ_IPS]
    assert DROP not in plan.elements


def test_node_port_addresses_scheduler_and_local_policies() -> None:
    settings = DataplaneSettings(
        node_port_networks=(ip_network("192.168.0.0/24"),), ipvs=IPVSOptions(scheduler="sh")
    )
    plan = plan_port(
        web(
            external_masquerade=False,
            drop_when_no_external_endpoints=True,
            drop_when_no_cluster_endpoints=True,
        ),
        NODE,
        settings,
    )
    node_port = VirtualKey(4, "tcp", "192.168.0.1", 30080)
    assert VirtualKey(4, "tcp", "10.1.0.1", 30080) not in plan.virtual_servers
    assert plan.virtual_servers[node_port].scheduler == "sh"
    assert MASQ_IPS not in plan.elements  # externalTrafficPolicy Local keeps the source
    assert plan.elements[DROP] == {(4, "10.96.0.10", "tcp", 80), (4, "192.168.0.1", "tcp", 30080)}


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (SETTINGS, "ip saddr != { 10.244.0.0/16 } meta mark set meta mark | 0x00004000"),
        (
            DataplaneSettings(masquerade_all=True),
            "@cluster-ips meta mark set meta mark | 0x00004000",
        ),
        (
            DataplaneSettings(detect_local=DetectLocal(DetectLocalMode.BRIDGE_INTERFACE, "cbr0")),
            'iifname != "cbr0" meta mark',
        ),
        (
            DataplaneSettings(
                detect_local=DetectLocal(DetectLocalMode.INTERFACE_NAME_PREFIX, "veth")
            ),
            'iifname != "veth*" meta mark',
        ),
        # Nothing tells local pods apart: only the node's own traffic from a Service IP (as
        # upstream's ipvs mode), not everything.
        (DataplaneSettings(), "ip saddr . meta l4proto . th dport @cluster-ips meta mark set"),
    ],
)
def test_helper_table_masquerades_what_is_not_from_a_local_pod(
    settings: DataplaneSettings, match: str
) -> None:
    text = base_table(
        settings, node_facts(settings, NODE)[4], {CLUSTER_IPS: [(4, "10.96.0.10", "tcp", 80)]}
    )
    assert match in text
    assert "meta mark & 0x00004000 == 0x00004000 masquerade" in text
    assert "add element ip kpx-ipvs cluster-ips { 10.96.0.10 . tcp . 80 }" in text


@pytest.mark.parametrize("masquerade_all", [True, False])
def test_spec_ipvs_masquerade_all_and_bit_reach_the_helper_table(masquerade_all: bool) -> None:
    """spec.ipvs.masqueradeAll and masqueradeBit (upstream's ipvs mode reads them from its
    iptables block) become the backend's settings: every packet to a cluster IP is marked
    with that bit, or only what detectLocal says is not from a local pod."""
    config = settings_mod.load(
        "ipvs",
        None,
        {
            "clusterCIDRs": ["10.244.0.0/16"],
            "ipvs": {
                "acknowledgeDeprecation": True,
                "masqueradeAll": masquerade_all,
                "masqueradeBit": 3,
            },
        },
    )
    proxy = settings_mod.resolve(config).proxy
    assert (proxy.masquerade_all, proxy.masquerade_mark) == (masquerade_all, 0x8)
    text = base_table(
        proxy, node_facts(proxy, NODE)[4], {CLUSTER_IPS: [(4, "10.96.0.10", "tcp", 80)]}
    )
    mark = "meta mark set meta mark | 0x00000008"
    everything = f"ip daddr . meta l4proto . th dport @cluster-ips {mark}\n"
    assert (everything in text) is masquerade_all
    assert (f"ip saddr != {{ 10.244.0.0/16 }} {mark}" in text) is not masquerade_all
    assert "meta mark & 0x00000008 == 0x00000008 masquerade" in text


def test_load_balancer_source_ranges_let_only_their_sources_through() -> None:
    port = web(
        E1,
        load_balancer_ips=(IP.of("192.0.2.21"),),
        load_balancer_source_ranges=(
            ip_network("10.0.0.0/8"),
            ip_network("10.1.0.0/16"),
            ip_network("fd00::/8"),
        ),
    )
    plan = plan_port(port, NODE, SETTINGS)
    assert plan.elements[FIREWALL] == {(4, "192.0.2.21", "tcp", 80)}
    # Merged (an interval set refuses overlaps) and of the port's family only.
    vip = (4, "192.0.2.21", "tcp", 80)
    assert plan.firewall == {vip: (ip_network("10.0.0.0/8"),)}
    allowed = allowed_elements(vip, plan.firewall.values())
    assert allowed == {(4, "192.0.2.21", "tcp", 80, "10.0.0.0/8")}
    text = base_table(
        SETTINGS, node_facts(SETTINGS, NODE)[4], {**plan.elements, FIREWALL_ALLOW: allowed}
    )
    assert "add element ip kpx-ipvs firewall-allow { 192.0.2.21 . tcp . 80 . 10.0.0.0/8 }" in text
    assert (
        "@firewall-ips ip daddr . meta l4proto . th dport . ip saddr != @firewall-allow drop"
        in (text)
    )
    assert FIREWALL not in plan_port(web(E1), NODE, SETTINGS).elements


def test_a_load_balancer_with_no_usable_source_range_lets_no_source_through() -> None:
    port = web(E1, load_balancer_ips=(IP.of("192.0.2.21"),), load_balancer_closed=True)
    plan = plan_port(port, NODE, SETTINGS)
    assert plan.elements[FIREWALL] == {(4, "192.0.2.21", "tcp", 80)}
    assert FIREWALL_ALLOW not in plan.elements  # an empty allow set: every source is dropped


@pytest.fixture
def fake() -> FakeKernel:
    return FakeKernel()


def backend_for(fake: FakeKernel) -> IpvsBackend:
    return IpvsBackend(SETTINGS, fake)


def state(*ports: ServicePort) -> NodeLocalState:
    return local_state(NODE, SETTINGS, ports)


DNS = ServicePort(
    key("dns", Protocol.UDP),
    53,
    cluster_ips=(IP.of("10.96.0.10"),),
    cluster_endpoints=(E1, E2),
    external_endpoints=(E1, E2),
)


def test_a_change_to_one_port_touches_only_its_virtual_servers(fake: FakeKernel) -> None:
    b = backend_for(fake)
    b.sync(state(web(E1, E2), DNS), None)
    assert len(fake.fake_ipvs.virtual_servers) == 4
    assert all(vs.scheduler == "rr" for vs in fake.fake_ipvs.virtual_servers.values())
    assert fake.bound == {(4, "10.96.0.10")}
    fake.fake_ipvs.calls.clear()
    nft_before = len(fake.scripts())
    # DNS loses E2: UDP real servers leave at once; web is not touched at all.
    dns_e1 = ServicePort(
        **{**_fields(DNS), "cluster_endpoints": (E1,), "external_endpoints": (E1,)}
    )
    b.sync(state(web(E1, E2), dns_e1), [DNS.key])
    assert fake.fake_ipvs.calls == [("delete_dest", "10.96.0.10", "10.244.2.2")]
    # One nft transaction: E2's UDP hairpin element leaves (its TCP one stays, for web).
    assert fake.scripts()[nft_before:] == [
        "delete element ip kpx-ipvs hairpin { 10.244.2.2 . udp . 8080 . 10.244.2.2 }\n"
    ]
    # Removing the whole DNS port removes its virtual server, not the shared address.
    fake.fake_ipvs.calls.clear()
    b.sync(state(web(E1, E2)), [DNS.key])
    assert fake.fake_ipvs.calls == [("delete_service", "10.96.0.10", "53")]
    assert fake.bound == {(4, "10.96.0.10")}
    b.sync(state(), [web(E1, E2).key])
    assert fake.fake_ipvs.virtual_servers == {} and fake.bound == set()


def test_a_removed_tcp_real_server_drains_at_weight_0_then_leaves(fake: FakeKernel) -> None:
    b = backend_for(fake)
    b.sync(state(web(E1, E2)), None)
    vip = VirtualKey(4, "tcp", "10.96.0.10", 80)
    fake.fake_ipvs.conns[(vip, ("10.244.2.2", 8080))] = 3
    b.sync(state(web(E1)), [key("web")])
    assert fake.fake_ipvs.dests[vip] == {("10.244.1.2", 8080): 1, ("10.244.2.2", 8080): 0}
    assert b.draining() == {vip: {("10.244.2.2", 8080)}}  # the NodePorts had no connection
    b.sync(state(web(E1)), [])  # still connections: stays at weight 0
    assert ("10.244.2.2", 8080) in fake.fake_ipvs.dests[vip]
    # Back before it drained: it serves again with its weight.
    b.sync(state(web(E1, E2)), [key("web")])
    assert fake.fake_ipvs.dests[vip][("10.244.2.2", 8080)] == 1 and b.draining() == {}
    b.sync(state(web(E1)), [key("web")])
    fake.fake_ipvs.conns.clear()
    b.sync(state(web(E1)), [])
    assert fake.fake_ipvs.dests[vip] == {("10.244.1.2", 8080): 1} and b.draining() == {}


def test_a_full_sync_serves_again_what_an_earlier_run_left_draining(fake: FakeKernel) -> None:
    vip = VirtualKey(4, "tcp", "10.96.0.10", 80)
    b = backend_for(fake)
    b.sync(state(web(E1, E2)), None)
    fake.fake_ipvs.conns[(vip, ("10.244.2.2", 8080))] = 1
    b.sync(state(web(E1)), [key("web")])
    assert fake.fake_ipvs.dests[vip][("10.244.2.2", 8080)] == 0
    # A new backend (an agent restart: no record of what drains) wants E2 back, and a full
    # sync without E1 leaves E1 draining at weight 0, not deleted with its connection.
    fake.fake_ipvs.conns[(vip, ("10.244.1.2", 8080))] = 1
    again = backend_for(fake)
    again.sync(state(web(E2)), None)
    assert fake.fake_ipvs.dests[vip] == {("10.244.1.2", 8080): 0, ("10.244.2.2", 8080): 1}
    assert again.draining()[vip] == {("10.244.1.2", 8080)}


def test_a_failed_sync_drops_what_it_queued_and_the_next_is_full(
    fake: FakeKernel,
) -> None:
    b = backend_for(fake)
    b.sync(state(web(E1)), None)

    fake.refuse_nft = lambda txn: "refused"
    with pytest.raises(backend_mod.BackendError, match="refused"):
        b.sync(state(web(E1, E2)), [key("web")])
    assert fake.fake_ipvs.calls[-1] == ("discard",)
    fake.refuse_nft = None
    fake.fake_ipvs.calls.clear()
    b.sync(state(web(E1, E2)), [key("web")])  # a delta asked for; a full sync done
    assert ("set_service", "10.96.0.10", "80") in fake.fake_ipvs.calls


def test_a_full_sync_removes_strangers_but_not_excluded_ones(fake: FakeKernel) -> None:
    stranger = VirtualKey(4, "tcp", "192.168.60.1", 80)
    kept = VirtualKey(4, "tcp", "192.168.50.1", 80)
    for k in (stranger, kept):
        fake.fake_ipvs.add_service(VirtualServer(k, "rr", 0, frozenset()))
    settings = DataplaneSettings(ipvs=IPVSOptions(exclude_cidrs=(ip_network("192.168.50.0/24"),)))
    b = IpvsBackend(settings, fake)
    b.sync(state(web(E1)), None)
    assert kept in fake.fake_ipvs.virtual_servers and stranger not in fake.fake_ipvs.virtual_servers


def test_a_scheduler_change_resyncs_every_virtual_server(fake: FakeKernel) -> None:
    b = backend_for(fake)
    b.sync(state(web(E1)), None)
    b.reconfigure(
        DataplaneSettings(cluster_cidrs=SETTINGS.cluster_cidrs, ipvs=IPVSOptions(scheduler="lc"))
    )
    b.sync(state(web(E1)), [])  # the agent asks for a delta; new settings force a full sync
    assert {vs.scheduler for vs in fake.fake_ipvs.virtual_servers.values()} == {"lc"}


def _fields(port: ServicePort) -> dict[str, Any]:
    return {name: getattr(port, name) for name in port.__slots__}


def test_the_backend_module_is_registered_and_gated() -> None:
    from kpx_agent import backends
    from kpx_api.modes import MODES_WITH_BACKEND, Mode

    assert Mode.IPVS in MODES_WITH_BACKEND
    module = backends.load("ipvs")
    assert module.create(SETTINGS).mode == "ipvs"
    assert backend_mod.cleanup is module.cleanup


def allow_set(scripts: list[str]) -> set[str]:
    """The firewall-allow elements after the helper-table scripts, in order (a full sync's
    table swap starts from none)."""
    have: set[str] = set()
    for script in scripts:
        for line in script.splitlines():
            if line == "delete table ip kpx-ipvs":
                have = set()
            words = line.split(" ", 5)
            if words[1:4] == ["element", "ip", "kpx-ipvs"] and words[4] == "firewall-allow":
                found = {e.strip() for e in words[5].strip("{} ").split(",")}
                have = have | found if words[0] == "add" else have - found
    return have


def test_two_services_on_one_lb_port_share_the_ranges_both_allow(fake: FakeKernel) -> None:
    """Overlapping ranges of two Services on one address and port, the second in a later
    partial sync: the kernel would refuse both in its interval set; the helper table holds
    what both allow, and the wider Service's ranges once the narrower one is gone."""
    lb = {"load_balancer_ips": (IP.of("192.0.2.21"),)}
    a = web(E1, load_balancer_source_ranges=(ip_network("10.0.0.0/8"),), **lb)
    b = ServicePort(
        **{
            **_fields(a),
            "key": key("b"),
            "cluster_ips": (IP.of("10.96.0.11"),),
            "node_port": 30081,
            "load_balancer_source_ranges": (ip_network("10.1.0.0/16"),),
        }
    )
    backend = backend_for(fake)
    backend.sync(state(a), None)
    assert allow_set(fake.scripts()) == {"192.0.2.21 . tcp . 80 . 10.0.0.0/8"}
    backend.sync(state(a, b), [b.key])
    assert allow_set(fake.scripts()) == {"192.0.2.21 . tcp . 80 . 10.1.0.0/16"}
    fresh = FakeKernel()
    IpvsBackend(SETTINGS, fresh).sync(state(b, a), None)
    assert allow_set(fresh.scripts()[-2:]) == {"192.0.2.21 . tcp . 80 . 10.1.0.0/16"}  # the same
    backend.sync(state(a), [b.key])
    assert allow_set(fake.scripts()) == {"192.0.2.21 . tcp . 80 . 10.0.0.0/8"}


def test_a_helper_table_family_the_kernel_refuses_does_not_stop_the_other(
    fake: FakeKernel,
) -> None:
    fake.refuse_nft = lambda txn: "Operation not supported" if txn.family == 4 else None
    six = ServicePort(
        ServicePortKey("d", "web6", "", Protocol.TCP, 6),
        80,
        cluster_ips=(IP.of("fd00:96::10"),),
        cluster_endpoints=(),
        external_endpoints=(),
    )
    with pytest.raises(backend_mod.BackendError, match="IPv4 helper table"):
        IpvsBackend(SETTINGS, fake).sync(state(web(E1), six), None)
    assert any("fd00:96::10 . tcp . 80" in script for script in fake.scripts())  # IPv6's went in


@pytest.mark.parametrize("claimant_first", [True, False])
def test_a_clashing_external_ip_leaves_the_victims_virtual_server_to_the_victim(
    fake: FakeKernel, claimant_first: bool
) -> None:
    """The model decides VIP clashes (vip_claims.py): an externalIP equal to another Service's
    ClusterIP does not replace that ClusterIP's real servers, whatever came first."""
    from test_vip_claims import BY_EXTERNAL, VICTIM, endpoints, proxier_with

    from kpx_agent.store.cluster_state import SERVICES, SLICES

    state, proxier = proxier_with(backend_for(fake))
    state.upsert(SERVICES, BY_EXTERNAL)
    state.upsert(SLICES, endpoints("a", "by-external", "10.244.2.7"))
    if claimant_first:
        assert proxier.sync().ok
    state.upsert(SERVICES, VICTIM)
    state.upsert(SLICES, endpoints("z", "victim", "10.244.2.2"))
    assert proxier.sync().ok
    assert fake.fake_ipvs.dests[VirtualKey(4, "tcp", "10.96.0.10", 80)] == {("10.244.2.2", 8080): 1}


def test_the_ipvs_sysctls_are_set_and_a_refused_one_fails_the_sync_naming_it(
    fake: FakeKernel,
) -> None:
    """As upstream's ipvs mode: vs.conntrack (without it nft cannot masquerade what IPVS
    forwards), expire_nodest_conn and expire_quiescent_template. A sysctl the node refuses
    fails the sync, saying which (upstream's proxier refuses to start); the next sync tries
    again."""
    b = backend_for(fake)
    fake.refuse_sysctl = "cannot set net.ipv4.vs.conntrack=1 (/proc/sys/...: Read-only file system)"
    with pytest.raises(backend_mod.BackendError, match=r"net\.ipv4\.vs\.conntrack=1"):
        b.sync(state(web(E1)), None)
    fake.refuse_sysctl = None
    b.sync(state(web(E1)), [key("web")])  # full again: the failed one left no node
    assert fake.sysctls == {
        "net.ipv4.vs.conntrack": 1,
        "net.ipv4.vs.expire_nodest_conn": 1,
        "net.ipv4.vs.expire_quiescent_template": 1,
    }


def test_a_sysctl_is_written_under_the_given_directory_and_only_when_it_differs(
    tmp_path: Path,
) -> None:
    """The agent's pod has the node's net/ipv4 sysctls mounted elsewhere (--ipv4-sysctl-dir);
    a value already right is not written (a read-only file that holds it is no error); a
    missing one (ip_vs not loaded) is a KernelError naming the sysctl, file and directory."""
    from kpx_agent.backends.ipvs import kernel as ipvs_kernel

    vs = tmp_path / "vs"
    vs.mkdir()
    conntrack = vs / "conntrack"
    conntrack.write_text("0\n")
    node = ipvs_kernel.NodeKernel(tmp_path)
    node.write_sysctl("net.ipv4.vs.conntrack", 1)
    assert conntrack.read_text() == "1\n"
    conntrack.chmod(0o444)
    conntrack.write_text("1\n")
    before = conntrack.stat().st_mtime_ns
    node.write_sysctl("net.ipv4.vs.conntrack", 1)
    assert conntrack.stat().st_mtime_ns == before  # not written again
    with pytest.raises(ipvs_kernel.KernelError) as err:
        node.write_sysctl("net.ipv4.vs.expire_nodest_conn", 1)
    assert "net.ipv4.vs.expire_nodest_conn=1" in str(err.value)
    assert str(vs / "expire_nodest_conn") in str(err.value) and "--ipv4-sysctl-dir" in str(
        err.value
    )
    assert ipvs_kernel.sysctl_path("net.ipv4.conf.all.arp_ignore", tmp_path) == (
        tmp_path / "conf" / "all" / "arp_ignore"
    )
    with pytest.raises(ValueError, match=r"not a net\.ipv4 sysctl"):
        ipvs_kernel.sysctl_path("net.netfilter.nf_conntrack_max", tmp_path)
