"""Issue requirement: a hand-written nftables DNAT in a node netns sends a client pod's
connections to a Service-like IP to two backend pods on two different nodes; both answer.

No masquerade is needed: node2 routes node1's pod CIDR back to node1, so the remote backend's
replies return through node1's conntrack; the local backend's replies are bridged on cbr0 and
are un-NATed only because bridge-nf-call-iptables=1 in node1 (the Topology sets it).
"""

from __future__ import annotations

import subprocess

import pytest

from kpx_cluster import echo_server
from kpx_cluster.netns import Topology
from kpx_cluster.probe import probe

pytestmark = pytest.mark.netns

VIP, VPORT, BACKEND_PORT = "10.96.0.10", 80, 8080

RULES = """
table ip kpxtest {{
    chain prerouting {{
        type nat hook prerouting priority -100; policy accept;
        ip daddr {vip} tcp dport {vport} dnat to numgen random mod 2 map {{
            0 : {b1},
            1 : {b2}
        }} : {port}
    }}
}}
"""


def host_ruleset() -> str:
    """The host netns ruleset (a read-only listing)."""
    return subprocess.run(
        ["nft", "list", "ruleset"], capture_output=True, text=True, check=True
    ).stdout


def test_handwritten_dnat_reaches_backends_on_two_nodes(topology: Topology) -> None:
    before = host_ruleset()
    node1, node2 = topology.add_node("node1"), topology.add_node("node2")
    b1 = topology.add_pod(node1, "backend1")
    b2 = topology.add_pod(node2, "backend2")
    client = topology.add_pod(node1, "client")
    for pod in (b1, b2):
        echo_server.start(topology, pod, pod.name, BACKEND_PORT, udp=False)

    # Without the rule the VIP leads nowhere: the probe must not pass by accident.
    unrouted = probe(topology, client, VIP, VPORT, "tcp", count=1, timeout=0.5)
    assert unrouted.answers == {}, unrouted

    rules = RULES.format(vip=VIP, vport=VPORT, b1=b1.ipv4, b2=b2.ipv4, port=BACKEND_PORT)
    topology.exec(node1, ["nft", "-f", "-"], input=rules, check=True)

    result = probe(topology, client, VIP, VPORT, "tcp", count=40, timeout=2)
    assert result.backends == {"backend1", "backend2"}, result
    assert result.answered == 40, result
    assert (result.refused, result.timeout, result.errors) == (0, 0, {}), result
    # no SNAT anywhere: both backends saw the client pod's own address
    assert result.sources == {"backend1": [client.ipv4], "backend2": [client.ipv4]}, result

    assert host_ruleset() == before, "the host netns ruleset changed"
