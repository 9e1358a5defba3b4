"""No single Service takes the dataplane down, in a real kernel (fresh network namespaces).

The poison pair: two Services on one load-balancer IP and port with overlapping
loadBalancerSourceRanges (10.0.0.0/8 and 10.244.0.0/16), the second arriving in a later
partial sync (a second tenant). The kernel refuses overlapping intervals in one set, so this
once made every sync fail until the pair was deleted. Now a third Service created afterwards is
programmed and answers, and the load balancer answers the sources both Services allow."""

from __future__ import annotations

import sys

import pytest

from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.probe import probe

pytestmark = pytest.mark.netns

LB = "192.0.2.50"
C_VIP = "10.96.0.52"

# Runs inside n1's netns: argv = mode, b1, b2, n1, load-balancer IP, the later cluster IP.
POISON_PAIR = """
import sys
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.nftables.backend import NftablesBackend
ip = IP.of
mode, b1, b2, n1, lb, c_vip = sys.argv[1:7]
eps = (Endpoint(ip(b1), 8080, True), Endpoint(ip(b2), 8080))
def port(name, vip, **kw):
    key = ServicePortKey("d", name, "", Protocol.TCP, 4)
    return ServicePort(key, 80, cluster_ips=(ip(vip),), cluster_endpoints=eps,
                       external_endpoints=eps, **kw)
a = port("a", "10.96.0.50", load_balancer_ips=(ip(lb),),
         load_balancer_source_ranges=(net("10.0.0.0/8"),))
b = port("b", "10.96.0.51", load_balancer_ips=(ip(lb),),
         load_balancer_source_ranges=(net("10.244.0.0/16"),))
c = port("c", c_vip)
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),))
backend = {"nftables": NftablesBackend, "iptables": IptablesBackend}[mode](settings)
state = local_state(NodeInfo("n1", (ip(n1),)), settings, [a])
backend.sync(state, None)
for later in (b, c):
    state.services[later.key] = later
    backend.sync(state, [later.key])
print("synced")
"""


def setup(topology: Topology) -> tuple[Node, Pod, Pod, Pod]:
    n1, n2 = topology.add_node("n1"), topology.add_node("n2")
    b1, b2 = topology.add_pod(n1, "b1"), topology.add_pod(n2, "b2")
    client = topology.add_pod(n1, "client")
    for pod in (b1, b2):
        topology.run_ready(
            pod,
            topology.python_argv("kpx_cluster.echo_server", "--name", pod.name, "--port", "8080"),
        )
    return n1, b1, b2, client


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_poison_pair_in_later_syncs_blocks_nothing(topology: Topology, mode: str) -> None:
    n1, b1, b2, client = setup(topology)
    argv = [sys.executable, "-c", POISON_PAIR, mode, b1.ipv4, b2.ipv4, n1.ipv4, LB, C_VIP]
    result = topology.exec(n1, argv)
    assert result.returncode == 0 and "synced" in result.stdout, result.stderr
    later = probe(topology, client, C_VIP, 80, "tcp", count=20, timeout=1)
    assert later.failed == 0 and later.backends == {"b1", "b2"}, later
    shared = probe(topology, client, LB, 80, "tcp", count=10, timeout=1)
    assert shared.failed == 0 and shared.backends, shared


# The ipvs mode's helper nftables table, in a real kernel; IPVS itself is faked (this kernel
# may have none: test_ipvs_kernel.py runs in a proxy-vm guest). Runs inside n1's netns.
IPVS_HELPER = """
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.backends.ipvs import kernel
from kpx_agent.backends.ipvs.backend import IpvsBackend
from kpx_agent.backends.ipvs.fake import FakeKernel
from kpx_agent.model.service_ports import local_state
ip = IP.of

class HelperTableOnly(FakeKernel):  # IPVS, sysctls and the dummy faked; the helper table real
    def run_nft(self, transaction):
        kernel.NodeKernel().run_nft(transaction)

def port(name, vip, node_port, **kw):
    key = ServicePortKey("d", name, "", Protocol.TCP, 4)
    return ServicePort(key, 80, cluster_ips=(ip(vip),), node_port=node_port, **kw)
lb = {"load_balancer_ips": (ip("192.0.2.50"),)}
a = port("a", "10.96.0.50", 30050, load_balancer_source_ranges=(net("10.0.0.0/8"),), **lb)
b = port("b", "10.96.0.51", 30051, load_balancer_source_ranges=(net("10.244.0.0/16"),), **lb)
c = port("c", "10.96.0.52", 30052)
backend = IpvsBackend(DataplaneSettings(), HelperTableOnly())
state = local_state(NodeInfo("n1", ()), DataplaneSettings(), [a])
backend.sync(state, None)
for later in (b, c):
    state.services[later.key] = later
    backend.sync(state, [later.key])
print("synced")
"""


def test_poison_pair_in_later_syncs_in_the_ipvs_helper_table(topology: Topology) -> None:
    n1 = topology.add_node("n1")
    result = topology.exec(n1, [sys.executable, "-c", IPVS_HELPER])
    assert result.returncode == 0 and "synced" in result.stdout, result.stderr
    listed = topology.exec(n1, ["nft", "list", "table", "ip", "kpx-ipvs"], check=True).stdout
    assert "10.96.0.52 . tcp . 80" in listed, listed  # the later Service is programmed
    assert "192.0.2.50 . tcp . 80 . 10.244.0.0/16" in listed, listed  # what both allow
    assert "10.0.0.0/8" not in listed, listed


# The proxier with the nftables backend in n1's netns; the Service "poison" renders, in IPv6
# only, a dispatch to a chain that does not exist (the kernel refuses it: ENOENT) - a stand-in
# for any element the kernel refuses. argv = b1, b2.
REFUSED = """
import sys
from kpx_agent.backends.nftables import backend as nft_backend
from kpx_agent.backends.nftables import names as n
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.nftables.schema import Goto
from kpx_agent.store.cluster_state import NAMESPACES, NODES, SERVICES, SLICES, ClusterState
from kpx_agent.model.types import DataplaneSettings
from kpx_agent.observability.metrics import AgentMetrics
from kpx_agent.sync.proxier import DATAPLANE, Proxier
from kpx_api.proxysettings import NamespaceOptOut
from ipaddress import ip_network

render_port = nft_backend.render_port
def poisoned(sp):
    out = render_port(sp)
    if sp.key.name == "poison" and sp.family == 6:
        out.elements.append((n.SERVICE_IPS, (sp.cluster_ips[0], sp.protocol, 81), Goto("nowhere")))
    return out
nft_backend.render_port = poisoned

b1, b2 = sys.argv[1:3]
def service(name, *ips):
    fams = ["IPv6" if ":" in ip else "IPv4" for ip in ips]
    return {"metadata": {"namespace": "d", "name": name},
            "spec": {"clusterIPs": list(ips), "ipFamilies": fams,
                     "ports": [{"port": 80, "protocol": "TCP", "targetPort": 8080}]}}
def slice_of(name):
    return {"metadata": {"namespace": "d", "name": name + "-1",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4", "ports": [{"port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [b1]}, {"addresses": [b2]}]}
state = ClusterState()
for kind in (SERVICES, SLICES, NAMESPACES, NODES):
    state.replace(kind, [])
settings = DataplaneSettings(cluster_cidrs=(ip_network("10.244.0.0/16"),))
backend = NftablesBackend(settings)
proxier = Proxier(state, backend, "n1", NamespaceOptOut(), AgentMetrics(), settings)
proxier.delete_flows = lambda flows: 0
state.upsert(SERVICES, service("a", "10.96.0.60"))
state.upsert(SLICES, slice_of("a"))
assert proxier.sync().ok
state.upsert(SERVICES, service("poison", "10.96.0.61", "fd00:96::61"))
state.upsert(SLICES, slice_of("poison"))
state.upsert(SERVICES, service("c", "10.96.0.62"))
state.upsert(SLICES, slice_of("c"))
outcome = proxier.sync()
assert outcome.ok, outcome
print(sorted((p.name, p.reason, p.message) for p in proxier.problems.of(DATAPLANE)))
"""


def test_a_service_the_kernel_refuses_is_left_out_and_the_rest_programmed(
    topology: Topology,
) -> None:
    n1, b1, b2, client = setup(topology)
    result = topology.exec(n1, [sys.executable, "-c", REFUSED, b1.ipv4, b2.ipv4])
    assert result.returncode == 0, result.stderr
    assert "('poison', 'RefusedByKernel', 'IPv6 not programmed" in result.stdout, result.stdout
    for vip in ("10.96.0.60", "10.96.0.61", "10.96.0.62"):  # the culprit's IPv4 too
        answered = probe(topology, client, vip, 80, "tcp", count=6, timeout=1)
        assert answered.failed == 0 and answered.backends, (vip, answered)
    listed = topology.exec(n1, ["nft", "list", "map", "ip6", "kpx", "service-ips"]).stdout
    assert "fd00:96::61" not in listed, listed


CHECK_MODES = """
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.iptables import kernel as ipt_kernel
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.nftables.backend import NftablesBackend
ip = IP.of
key = ServicePortKey("d", "a", "", Protocol.TCP, 4)
ports = [ServicePort(key, 80, cluster_ips=(ip("10.96.0.70"),))]
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),))
for backend in (NftablesBackend(settings), IptablesBackend(settings)):
    state = local_state(NodeInfo("n1", ()), settings, ports)
    assert backend.check(state) is None, backend.mode
bad = "*nat\\n:KPX-A - [0:0]\\n-A KPX-A -m nosuchmatch -j ACCEPT\\nCOMMIT\\n"
refused = ipt_kernel.restore_test(4, bad)
assert refused and "nosuchmatch" in refused, refused
print("checked")
"""


def test_check_modes_answer_and_apply_nothing(topology: Topology) -> None:
    """nft --check and iptables-restore --test: a good ruleset is accepted, a bad one refused
    with the tool's message, and nothing is applied either way. (iptables-restore 1.8's
    --test checks what the tool itself refuses, a rule it cannot parse or an extension it
    cannot load; not a jump to a missing chain, which only the kernel refuses.)"""
    n1 = topology.add_node("n1")
    result = topology.exec(n1, [sys.executable, "-c", CHECK_MODES])
    assert result.returncode == 0 and "checked" in result.stdout, result.stderr
    assert "kpx" not in topology.exec(n1, ["nft", "list", "tables"], check=True).stdout
    saved = topology.exec(n1, ["iptables-save"], check=True).stdout
    assert "KPX-" not in saved, saved
