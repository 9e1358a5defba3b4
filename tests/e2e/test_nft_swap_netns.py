"""A full sync over a table already in the kernel (an agent's restart, a drift repair, a
takeover) swaps it in place without dropping a packet: new flows to a NodePort (looked up in
`nodeport-addresses`, then the endpoint maps) and packets to a load balancer with source
ranges (`firewall-allow`) keep being served while 60 swaps run, in nftables mode, in ipvs
mode's helper table and in iptables mode (its restores); and a swap in place leaves exactly the
new rules. A real kernel, in netns
the test makes (the nodes have no default route: nothing leaves them)."""

from __future__ import annotations

import sys

import pytest

from kpx_agent.backends.nftables.ruleset import endpoint_rule
from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.probe import probe

pytestmark = pytest.mark.netns

NODE_PORT = 30080
LB_IP = "192.0.2.40"
SWAPS = 60

# Counters in the node's netns: every packet the client sends (prerouting, before kpx), the
# ones kpx sent on to the backend (forward, after kpx's filter chains), and the NodePort
# packets that reached the node itself, not translated (a miss of `nodeport-addresses`).
PROBE = """table ip probe {{
  chain sent {{
    type filter hook prerouting priority -300; policy accept;
    ip saddr {client} udp dport {node_port} counter
    ip saddr {client} ip daddr {lb} udp dport 80 counter
  }}
  chain served {{
    type filter hook forward priority 100; policy accept;
    ip saddr {client} ip daddr {backend} udp dport 8080 counter
    ip saddr {client} ip daddr {backend} udp dport 8081 counter
  }}
  chain local {{
    type filter hook input priority 100; policy accept;
    ip saddr {client} udp dport {node_port} counter
  }}
}}
"""

# New flows, as fast as one process sends them: a fresh source port for each NodePort packet
# (the NAT rules, with their set lookups, see only a flow's first packet), alternating with
# packets to the load balancer (its source-range check sees every packet).
FLOOD = """
import socket, sys
node, lb = sys.argv[1], sys.argv[2]
lb_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print("ready", flush=True)
port = 20000
while True:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.bind(("", port))
        s.sendto(b"x", (node, {node_port}))
    except OSError:
        pass
    s.close()
    port = port + 1 if port < 59999 else 20000
    try:
        lb_sock.sendto(b"x", (lb, 80))
    except OSError:
        pass
"""

SWAPPER = """
import sys
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.types import IP
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.nftables.backend import NftablesBackend
from kpx_agent.backends.iptables.backend import IptablesBackend
ip = IP.of
swaps = int(sys.argv[1])
Backend = {{"nftables": NftablesBackend, "iptables": IptablesBackend}}[sys.argv[2]]
ports = [
    ServicePort(ServicePortKey("d", "np", "", Protocol.UDP, 4), 53, cluster_ips=(ip("10.96.0.40"),),
                node_port={node_port},
                cluster_endpoints=(Endpoint(ip("{backend}"), 8080, True),),
                external_endpoints=(Endpoint(ip("{backend}"), 8080, True),)),
    ServicePort(ServicePortKey("d", "lb", "", Protocol.UDP, 4), 80, cluster_ips=(ip("10.96.0.41"),),
                load_balancer_ips=(ip("{lb}"),),
                load_balancer_source_ranges=(net("{client}/32"),),
                cluster_endpoints=(Endpoint(ip("{backend}"), 8081, True),),
                external_endpoints=(Endpoint(ip("{backend}"), 8081, True),)),
]
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),))
state = local_state(NodeInfo("n1", (ip("{node}"),)), settings, ports)
backend = Backend(settings)
backend.sync(state, None)
for _ in range(swaps):
    # a new agent each time, as after a restart: its first sync is a full one
    backend = Backend(settings)
    backend.sync(state, None)
if swaps and Backend is NftablesBackend:
    script = backend.last_script
    assert "delete table" not in script, script[:2000]
    assert "flush set ip kpx nodeport-addresses" in script, script[:2000]
"""


def setup(topology: Topology) -> tuple[Node, Pod, Pod]:
    n1 = topology.add_node("n1")
    backend, client = topology.add_pod(n1, "b1"), topology.add_pod(n1, "client")
    # New flows reuse source ports every 40,000 packets: their conntrack entries (unanswered:
    # nothing listens on the backend) must be gone by then for the NAT rules to see them.
    for key in ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"):
        topology.exec(n1, ["sysctl", "-qw", f"net.netfilter.{key}=1"], check=True)
    return n1, backend, client


def counters(topology: Topology, node: Node) -> list[int]:
    listed = topology.exec(node, ["nft", "list", "table", "ip", "probe"], check=True).stdout
    lines = [line for line in listed.splitlines() if "packets " in line]
    return [int(line.split("packets ")[1].split()[0]) for line in lines]


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_full_syncs_over_the_table_drop_no_packet(topology: Topology, mode: str) -> None:
    """nftables: the swap in place. iptables: `iptables-restore` of the whole script over
    the chains in the kernel (declared chains flushed and written again, in one
    iptables-nft transaction), which keeps every chain: no packet lost either."""
    n1, backend, client = setup(topology)
    values = {"client": client.ipv4, "backend": backend.ipv4, "lb": LB_IP, "node": n1.ipv4}
    values["node_port"] = str(NODE_PORT)
    swapper = SWAPPER.format(**values)
    # The rules in place, then the probe's counters (before kpx's first packet).
    topology.exec(n1, [sys.executable, "-c", swapper, "0", mode], check=True, timeout=60)
    topology.exec(n1, ["nft", "-f", "-"], input=PROBE.format(**values), check=True)
    flood = topology.run_ready(
        client, [sys.executable, "-c", FLOOD.format(**values), n1.ipv4, LB_IP]
    )
    try:
        argv = [sys.executable, "-c", swapper, str(SWAPS), mode]
        topology.exec(n1, argv, check=True, timeout=300)
    finally:
        flood.kill()
        flood.wait()
    np_sent, lb_sent, np_served, lb_served, np_missed = counters(topology, n1)
    # Enough traffic ran through the swaps for a miss to show (each swap's window is short).
    assert np_served > 20 * SWAPS and lb_served > 20 * SWAPS, (np_served, lb_served)
    assert np_missed == 0, f"{np_missed} of {np_sent} NodePort packets were not translated"
    assert lb_sent == lb_served, f"{lb_sent - lb_served} of {lb_sent} LB packets were dropped"


RESHAPE = """
import sys
from kpx_agent.model.types import *
from kpx_agent.model.types import IP
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.nftables.backend import NftablesBackend
ip = IP.of
one = (Endpoint(ip("{backend}"), 8080, True),)
two = one + (Endpoint(ip("{backend}"), 8081, True),)
def port(name, vip, eps, **kw):
    return ServicePort(ServicePortKey("d", name, "", Protocol.TCP, 4), 80, cluster_ips=(ip(vip),),
                       cluster_endpoints=eps, external_endpoints=eps, **kw)
ports = [port("one", "10.96.0.50", one)]
if sys.argv[1] == "before":
    ports.append(port("two", "10.96.0.51", two))
    ports.append(port("sticky", "10.96.0.52", one, affinity_timeout=60))
settings = DataplaneSettings()
backend = NftablesBackend(settings)
backend.sync(local_state(NodeInfo("n1", (ip("{node}"),)), settings, ports), None)
script = backend.last_script
if sys.argv[1] == "after":
    assert "delete table" not in script, script[:3000]
    assert "delete chain ip kpx endpoints-2" in script, script[:3000]
    assert "add chain ip kpx endpoints-1" in script, script[:3000]  # made again
if sys.argv[1] == "again":
    assert "delete table" not in script, script[:3000]
    assert "add chain ip kpx endpoints-1" not in script, script[:3000]  # kept
    assert "flush map ip kpx endpoints-1" in script, script[:3000]
"""


def test_a_swap_in_place_deletes_what_the_new_rules_lack(topology: Topology) -> None:
    """Over a table with other Services, a changed endpoint chain and someone else's chain
    and set, the kernel takes the swap in place (no whole replace), and the table then holds
    exactly the new rules: each endpoint chain its one rule, nothing else, traffic served."""
    n1, backend, client = setup(topology)
    topology.run_ready(
        backend,
        topology.python_argv("kpx_cluster.echo_server", "--name", "b1", "--port", "8080"),
    )
    program = RESHAPE.format(backend=backend.ipv4, node=n1.ipv4)
    topology.exec(n1, [sys.executable, "-c", program, "before"], check=True)
    chains = nft_names(topology, n1, "chains")
    assert {"endpoints-1", "endpoints-2"} <= chains and any(c.startswith("aff-") for c in chains)
    tamper = [
        "add rule ip kpx endpoints-1 counter",
        "add chain ip kpx stray",
        "add set ip kpx stray-set { type ipv4_addr; }",
    ]
    topology.exec(n1, ["nft", "-f", "-"], input="\n".join(tamper) + "\n", check=True)
    topology.exec(n1, [sys.executable, "-c", program, "after"], check=True)
    listed = topology.exec(n1, ["nft", "list", "table", "ip", "kpx"], check=True).stdout
    chains = nft_names(topology, n1, "chains")
    assert "endpoints-1" in chains and not chains & {"endpoints-2", "stray"}, chains
    assert not any(c.startswith("aff-") for c in chains), chains
    assert "stray-set" not in listed and "map endpoints-2 " not in listed, listed
    chain = listed.split("chain endpoints-1 {")[1].split("}")[0]
    mark = endpoint_rule(4, "endpoints-1").comment
    assert [line.strip() for line in chain.strip().splitlines()] == [
        "dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 1 map @endpoints-1"
        f' comment "{mark}"'
    ], chain
    served = probe(topology, client, "10.96.0.50", 80, "tcp", count=10, timeout=1)
    assert served.backends == {"b1"} and served.failed == 0, served
    # Once more: the chain, read back with its mark, is kept; the rules are the same.
    topology.exec(n1, [sys.executable, "-c", program, "again"], check=True)
    assert topology.exec(n1, ["nft", "list", "table", "ip", "kpx"], check=True).stdout == listed
    served = probe(topology, client, "10.96.0.50", 80, "tcp", count=10, timeout=1)
    assert served.backends == {"b1"} and served.failed == 0, served


def nft_names(topology: Topology, node: Node, kind: str) -> set[str]:
    """The names of our table's chains (`kind` "chains") as `nft list chains` gives them."""
    listed = topology.exec(node, ["nft", "list", kind, "ip"], check=True).stdout
    names, table = set(), ""
    for line in listed.splitlines():
        words = line.split()
        if words[:1] == ["table"]:
            table = words[-2]
        elif words[:1] == ["chain"] and table == "kpx":
            names.add(words[1])
    return names


# The ipvs mode's helper table, in a real kernel; IPVS itself, the sysctls and the dummy
# interface faked (this host's kernel has no IPVS). Runs inside the node's netns.
IPVS_SWAPPER = """
import sys
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.types import IP
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.ipvs import kernel
from kpx_agent.backends.ipvs.backend import IpvsBackend
from kpx_agent.backends.ipvs.fake import FakeKernel
ip = IP.of

class HelperTableOnly(FakeKernel):
    scripts = []
    def run_nft(self, transaction):
        HelperTableOnly.scripts.append(transaction.render())
        kernel.NodeKernel().run_nft(transaction)
    def table_contents(self, family):
        return kernel.NodeKernel().table_contents(family)

eps = (Endpoint(ip("{backend}"), 8080, True),)
lb = ServicePort(ServicePortKey("d", "lb", "", Protocol.UDP, 4), 80,
                 cluster_ips=(ip("10.96.0.41"),), load_balancer_ips=(ip("{lb}"),),
                 load_balancer_source_ranges=(net("{client}/32"),),
                 cluster_endpoints=eps, external_endpoints=eps)
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),))
state = local_state(NodeInfo("n1", (ip("{node}"),)), settings, [lb])
for _ in range(1 + int(sys.argv[1])):
    IpvsBackend(settings, HelperTableOnly()).sync(state, None)  # a new agent: a full sync
last = HelperTableOnly.scripts[-2]  # (the IPv6 table's is the last)
if int(sys.argv[1]):
    assert "delete table" not in last and "flush set ip kpx-ipvs firewall-allow" in last, last
"""

LB_PROBE = """table ip probe {{
  chain sent {{
    type filter hook prerouting priority -300; policy accept;
    ip saddr {client} ip daddr {lb} udp dport 80 counter
  }}
  chain local {{
    type filter hook input priority 100; policy accept;
    ip saddr {client} ip daddr {lb} udp dport 80 counter
  }}
}}
"""

LB_FLOOD = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print("ready", flush=True)
while True:
    try:
        s.sendto(b"x", (sys.argv[1], 80))
    except OSError:
        pass
"""


def test_ipvs_helper_table_full_syncs_drop_no_packet(topology: Topology) -> None:
    """The same for ipvs mode's helper table: packets to a load balancer with source ranges
    (checked against the interval set `firewall-allow` on every packet) all reach the node
    while 60 new agents' full syncs swap the table in place."""
    n1, backend, client = setup(topology)
    values = {"client": client.ipv4, "backend": backend.ipv4, "lb": LB_IP, "node": n1.ipv4}
    # In ipvs mode the load-balancer IP is bound on the node (the dummy interface's job).
    topology.exec(n1, ["ip", "addr", "add", f"{LB_IP}/32", "dev", "lo"], check=True)
    swapper = IPVS_SWAPPER.format(**values)
    topology.exec(n1, [sys.executable, "-c", swapper, "0"], check=True, timeout=60)
    topology.exec(n1, ["nft", "-f", "-"], input=LB_PROBE.format(**values), check=True)
    flood = topology.run_ready(client, [sys.executable, "-c", LB_FLOOD, LB_IP])
    try:
        topology.exec(n1, [sys.executable, "-c", swapper, str(SWAPS)], check=True, timeout=300)
    finally:
        flood.kill()
        flood.wait()
    sent, arrived = counters(topology, n1)
    assert arrived > 20 * SWAPS, (sent, arrived)
    assert sent == arrived, f"{sent - arrived} of {sent} packets were dropped"
