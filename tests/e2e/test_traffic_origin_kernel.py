"""Where traffic comes from, in a real kernel, for both backends (driven in-process inside node
n1's netns): detectLocal in every mode (which sources are masqueraded on their way to a
cluster IP), the externalTrafficPolicy Local short circuit (local pods and the node itself
reach every cluster endpoint; external traffic is dropped), a FORWARD policy of DROP, and
localhost NodePorts (iptables, and nftables with its opt-in nftables.localhostNodePorts: the
node's 127.0.0.1:<nodePort> answers, a martian to 127.0.0.1 from outside is dropped).

The topology: n1 (the proxy), n2, and n3 (an external host: a node netns with no pods and no
proxy). Pods: b1 (echo, on n1's cbr0), b2 (echo, on n2), client (on n1's cbr0), rclient (on n1,
a routed veth named `<prefix>r<n>`, as bridgeless CNIs plumb pods), far (on n2). n2 and n3 route
the Service CIDR and the load-balancer range via n1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from three_node_net import ThreeNodes

from kpx_cluster.netns import Node, Topology
from kpx_cluster.probe import ProbeResult, probe

pytestmark = pytest.mark.netns
MODES = ("nftables", "iptables")
VIP, LB_IP, NODE_PORT, ETP_NODE_PORT = "10.96.0.10", "192.0.2.21", 30080, 30081

# Runs inside n1's netns: argv[1] is a JSON spec (mode, settings, node, endpoints).
PROGRAM = """
import json, sys
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.iptables.backend import IptablesBackend, cleanup as ipt_cleanup
from kpx_agent.backends.nftables.backend import NftablesBackend, cleanup as nft_cleanup

spec = json.loads(sys.argv[1])
ip = IP.of
if spec["step"] == "cleanup":
    (ipt_cleanup if spec["mode"] == "iptables" else nft_cleanup)()
    sys.exit(0)
b1 = (Endpoint(ip(spec["b1"]), 8080, True),)
b2 = (Endpoint(ip(spec["b2"]), 8080),)
tcp = Protocol.TCP
ports = [
    # A cluster IP served by b1 (on n1), with a NodePort (externalTrafficPolicy Cluster)
    # served by b2 (on n2).
    ServicePort(ServicePortKey("d", "web", "", tcp, 4), 80, cluster_ips=(ip("10.96.0.10"),),
                cluster_endpoints=b1, external_endpoints=b2, node_port=30080),
    # externalTrafficPolicy Local with its only endpoint on n2: none local to n1.
    ServicePort(ServicePortKey("d", "etp", "", tcp, 4), 80, cluster_ips=(ip("10.96.0.11"),),
                load_balancer_ips=(ip("192.0.2.21"),), node_port=30081,
                cluster_endpoints=b2, external_endpoints=(), short_circuit_endpoints=b2,
                external_masquerade=False, drop_when_no_external_endpoints=True),
]
mode, interface = spec["detect"]
settings = DataplaneSettings(
    cluster_cidrs=tuple(net(c) for c in spec["cluster_cidrs"]),
    detect_local=DetectLocal(DetectLocalMode(mode), interface),
    localhost_node_ports=spec["localhost"],
)
node = NodeInfo("n1", (ip(spec["n1"]),), pod_cidrs=tuple(net(c) for c in spec["pod_cidrs"]))
backend = (IptablesBackend if spec["mode"] == "iptables" else NftablesBackend)(settings)
backend.sync(local_state(node, settings, ports), None)
print("synced")
"""


class Net(ThreeNodes):
    def sync(self, mode: str, detect: tuple[str, str] = ("ClusterCIDR", ""), **kw: Any) -> None:
        spec = {
            "step": "sync",
            "mode": mode,
            "detect": list(detect),
            "cluster_cidrs": kw.get("cluster_cidrs", ["10.244.0.0/16"]),
            "pod_cidrs": kw.get("pod_cidrs", [self.n1.pod_cidr_v4]),
            "localhost": kw.get("localhost", False),
            "n1": self.n1.ipv4,
            "b1": self.pods["b1"].ipv4,
            "b2": self.pods["b2"].ipv4,
        }
        run = self.topo.exec(self.n1, [sys.executable, "-c", PROGRAM, json.dumps(spec)])
        assert run.returncode == 0 and "synced" in run.stdout, run.stderr

    def cleanup(self, mode: str) -> None:
        spec = json.dumps({"step": "cleanup", "mode": mode})
        self.topo.exec(self.n1, [sys.executable, "-c", PROGRAM, spec], check=True)

    def sh(self, where: Node, *argv: str) -> str:
        return self.topo.exec(where, list(argv), check=True).stdout


@pytest.fixture
def net(topology: Topology) -> Iterator[Net]:
    yield Net.build(topology)


def seen_by(result: ProbeResult, backend: str) -> set[str]:
    assert result.backends == {backend} and result.failed == 0, result
    return set(result.sources[backend])


# ---- detectLocal ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_detect_local_every_mode_decides_what_is_masqueraded(net: Net, mode: str) -> None:
    """Traffic to a cluster IP (served by b1 on n1) keeps its source when it comes from a
    local pod as the mode defines it, and is masqueraded (b1 sees n1's cbr0 address) when
    not; with nothing to match (NodeCIDR before the Node has a pod CIDR) nothing counts as
    local, so nothing is masqueraded as off-cluster (upstream's no-op detector)."""
    masq = net.n1.gateway_v4
    sources = {name: net.pods[name] for name in ("client", "rclient", "far")}
    prefix = net.pods["rclient"].host_if.rstrip("0123456789")
    own = {name: pod.ipv4 for name, pod in sources.items()} | {"n3": net.n3.ipv4}
    cases: list[tuple[tuple[str, str], dict[str, Any], set[str]]] = [
        # (detectLocal, settings, the senders whose source is kept)
        (("ClusterCIDR", ""), {}, {"client", "rclient", "far"}),
        (("NodeCIDR", ""), {}, {"client", "rclient"}),
        (("BridgeInterface", "cbr0"), {}, {"client"}),
        (("InterfaceNamePrefix", prefix), {}, {"rclient"}),
        (("NodeCIDR", ""), {"pod_cidrs": []}, {"client", "rclient", "far", "n3"}),
        (("ClusterCIDR", ""), {"cluster_cidrs": []}, {"client", "rclient", "far", "n3"}),
    ]
    for detect, settings, kept in cases:
        net.sync(mode, detect, **settings)
        for sender, target in (*sources.items(), ("n3", net.n3)):
            result = probe(net.topo, target, VIP, 80, "tcp", count=3, timeout=1)
            expected = own[sender] if sender in kept else masq
            assert seen_by(result, "b1") == {expected}, (mode, detect, settings, sender, result)


# ---- externalTrafficPolicy: Local short circuit --------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_etp_local_short_circuits_local_pods_and_the_node_and_drops_external(
    net: Net, mode: str
) -> None:
    """n1 has no local endpoint of the Local-policy Service: a pod on n1 and n1 itself still
    reach b2 through the load-balancer IP and the NodePort (the pod keeps its source, the
    node is masqueraded), while an external host's packets are dropped."""
    net.sync(mode)
    client, n1 = net.pods["client"], net.n1
    for host, port in ((LB_IP, 80), (n1.ipv4, ETP_NODE_PORT)):
        from_pod = probe(net.topo, client, host, port, "tcp", count=5, timeout=1)
        assert seen_by(from_pod, "b2") == {client.ipv4}, (mode, host, from_pod)
        from_node = probe(net.topo, n1, host, port, "tcp", count=5, timeout=1)
        assert seen_by(from_node, "b2") == {n1.ipv4}, (mode, host, from_node)
        external = probe(net.topo, net.n3, host, port, "tcp", count=2, timeout=0.5)
        assert external.timeout == 2 and external.answered == 0, (mode, host, external)
    # With detectLocal matching nothing, a pod's packets are not short-circuited: dropped.
    net.sync(mode, ("NodeCIDR", ""), pod_cidrs=[])
    dropped = probe(net.topo, client, LB_IP, 80, "tcp", count=2, timeout=0.5)
    assert dropped.timeout == 2 and dropped.answered == 0, (mode, dropped)
    from_node = probe(net.topo, n1, LB_IP, 80, "tcp", count=3, timeout=1)
    assert seen_by(from_node, "b2") == {n1.ipv4}, (mode, from_node)  # the node still is


# ---- FORWARD policy DROP -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_forward_policy_drop(net: Net, mode: str) -> None:
    """n1's iptables FORWARD policy is DROP (as Docker sets it). In iptables mode KPX-FORWARD
    accepts what the proxy marked for masquerade and its connections, so an external host
    reaches b2 (on n2) through n1's NodePort. In nftables mode, as upstream's, nothing can
    override another table's drop: the same traffic is dropped (documented in docs/api.md)."""
    net.sh(net.n1, "iptables", "-P", "FORWARD", "DROP")
    net.sync(mode)
    result = probe(net.topo, net.n3, net.n1.ipv4, NODE_PORT, "tcp", count=5, timeout=1)
    if mode == "iptables":
        assert seen_by(result, "b2") == {net.n1.ipv4}, result
    else:
        assert result.answered == 0, result


# ---- localhost NodePorts -------------------------------------------------------------------------

MARTIAN_PORT = 5353  # a UDP port on n1's 127.0.0.1 that no Service has

# Runs in n1: a UDP socket on 127.0.0.1:argv[1]; says "got <source>" for the first datagram
# within argv[2] seconds, or "none".
LISTEN = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.settimeout(float(sys.argv[2]))
print("ready", flush=True)
try:
    print("got", s.recvfrom(64)[1][0], flush=True)
except TimeoutError:
    print("none", flush=True)
"""

# Runs in n3: a martian, written as a raw Ethernet frame (the kernel's own routing would keep a
# packet to 127.0.0.1 at home): UDP from n3's address to 127.0.0.1:argv[5], to n1's MAC.
SEND_MARTIAN = """
import socket, struct, sys
iface, src_mac, dst_mac, src, dport = sys.argv[1:6]
def checksum(data):
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF
payload = b"martian!"
udp = struct.pack("!HHHH", 40000, int(dport), 8 + len(payload), 0) + payload  # no checksum
addrs = socket.inet_aton(src) + socket.inet_aton("127.0.0.1")
head = struct.pack("!BBHHHBBH", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0) + addrs
head = head[:10] + struct.pack("!H", checksum(head)) + head[12:]
mac = lambda text: bytes.fromhex(text.replace(":", ""))
frame = mac(dst_mac) + mac(src_mac) + b"\\x08\\x00" + head + udp
with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as sock:
    sock.bind((iface, 0))
    for _ in range(3):
        sock.send(frame)
print("sent")
"""


def route_localnet(net: Net) -> str:
    return net.sh(net.n1, "sysctl", "-n", "net.ipv4.conf.all.route_localnet").strip()


def martian_reaches_n1(net: Net) -> bool:
    """Whether a packet from n3 to 127.0.0.1 on n1 (UDP, to a socket bound there) arrives."""
    mac = {
        node.name: net.sh(node, "cat", f"/sys/class/net/{node.fabric_if}/address").strip()
        for node in (net.n1, net.n3)
    }
    argv = [sys.executable, "-c", LISTEN, str(MARTIAN_PORT), "2"]
    listener = net.topo.run(net.n1, argv, stdout=subprocess.PIPE)
    assert listener.stdout is not None and listener.stdout.readline().strip() == b"ready"
    sender = [
        sys.executable,
        "-c",
        SEND_MARTIAN,
        net.n3.fabric_if,
        mac["n3"],
        mac["n1"],
        net.n3.ipv4,
        str(MARTIAN_PORT),
    ]
    assert "sent" in net.sh(net.n3, *sender)
    out, _ = listener.communicate(timeout=10)
    said = out.decode().split()
    assert said in (["got", net.n3.ipv4], ["none"]), said
    return said[0] == "got"


def test_localhost_node_ports_iptables(net: Net) -> None:
    """iptables with localhostNodePorts: 127.0.0.1:<nodePort> on n1 reaches the endpoint
    (masqueraded), the agent set route_localnet=1 in n1's netns, and the martian guard is
    hooked in INPUT and OUTPUT and drops a packet to 127.0.0.1 from outside. Turned off: no
    127.0.0.1 NodePorts, and route_localnet is left as it was."""
    assert route_localnet(net) == "0"
    net.sync("iptables", localhost=True)
    result = probe(net.topo, net.n1, "127.0.0.1", NODE_PORT, "tcp", count=3, timeout=1)
    assert seen_by(result, "b2") == {net.n1.ipv4}, result
    assert route_localnet(net) == "1"
    saved = net.sh(net.n1, "iptables-save", "-t", "filter")
    for chain in ("INPUT", "OUTPUT"):
        assert f"-A {chain} -m comment --comment kpx -j KPX-LOCALNET" in saved, saved
    guard = "! -s 127.0.0.0/8 -d 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT"
    assert f"-A KPX-LOCALNET {guard} -j DROP" in saved, saved
    assert not martian_reaches_n1(net)

    net.sh(net.n1, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=0")
    net.sync("iptables", localhost=False)
    result = probe(net.topo, net.n1, "127.0.0.1", NODE_PORT, "tcp", count=3, timeout=1)
    assert result.refused == 3, result
    assert route_localnet(net) == "0"  # not touched
    assert "KPX-LOCALNET" not in net.sh(net.n1, "iptables-save", "-t", "filter")


NFT_GUARD = "ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 ct state != { established, related }"


def test_localhost_node_ports_nftables_opt_in(net: Net) -> None:
    """nftables.localhostNodePorts, kpx's opt-in beyond upstream's nftables mode. Off (the
    default): nothing answers on 127.0.0.1:<nodePort> and route_localnet stays 0. On:
    127.0.0.1:<nodePort> on n1 reaches the endpoint on n2 (masqueraded to n1's address), the
    backend set route_localnet=1, and the guard in the input and output hooks drops a
    packet to 127.0.0.1 from n3. Off again with route_localnet still 1 (the agent leaves it):
    the same martian arrives, so the guard is what dropped it."""
    assert route_localnet(net) == "0"
    net.sync("nftables")  # localhost NodePorts off, the default
    result = probe(net.topo, net.n1, "127.0.0.1", NODE_PORT, "tcp", count=3, timeout=1)
    assert result.refused == 3, result  # nothing listens there, nothing DNATs it
    assert route_localnet(net) == "0"
    assert NFT_GUARD not in net.sh(net.n1, "nft", "list", "table", "ip", "kpx")

    net.sync("nftables", localhost=True)
    result = probe(net.topo, net.n1, "127.0.0.1", NODE_PORT, "tcp", count=3, timeout=1)
    assert seen_by(result, "b2") == {net.n1.ipv4}, result
    # externalTrafficPolicy Local with no endpoint on n1: the node's own traffic is
    # short-circuited to every endpoint, from 127.0.0.1 too.
    result = probe(net.topo, net.n1, "127.0.0.1", ETP_NODE_PORT, "tcp", count=3, timeout=1)
    assert seen_by(result, "b2") == {net.n1.ipv4}, result
    assert route_localnet(net) == "1"
    for chain in ("filter-input", "filter-output"):
        listed = net.sh(net.n1, "nft", "list", "chain", "ip", "kpx", chain)
        assert NFT_GUARD in listed and "drop" in listed, listed
    assert NFT_GUARD not in net.sh(net.n1, "nft", "list", "table", "ip6", "kpx")  # IPv4 only
    assert not martian_reaches_n1(net)
    # The node's NodePort on its own address still answers from n3, as before.
    result = probe(net.topo, net.n3, net.n1.ipv4, NODE_PORT, "tcp", count=3, timeout=1)
    assert seen_by(result, "b2") == {net.n1.ipv4}, result

    net.sync("nftables", localhost=False)
    assert route_localnet(net) == "1"  # not touched
    assert martian_reaches_n1(net)  # the control: without the guard it arrives
    result = probe(net.topo, net.n1, "127.0.0.1", NODE_PORT, "tcp", count=3, timeout=1)
    assert result.refused == 3, result
    net.sh(net.n1, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=0")
    assert not martian_reaches_n1(net)  # and the kernel drops it itself once it is 0
