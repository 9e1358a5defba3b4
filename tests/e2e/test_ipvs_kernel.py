"""The ipvs backend in a kernel with IPVS: real packets through real virtual servers.

This host's kernel has no IPVS: these tests skip here and run inside a `proxy-vm` guest
(Debian's 6.1 kernel), started by tests/e2e/test_ipvs_in_vm.py, which fails if any of them
fails or skips there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.probe import probe

DRIVER = Path(__file__).with_name("ipvs_driver.py")


def _ipvs_in_kernel() -> bool:
    try:
        from kpx_agent.backends.ipvs.kernel import ipvs_available

        return ipvs_available()
    except ImportError:
        return False


pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(
        not _ipvs_in_kernel(),
        reason="this kernel has no IPVS: test_ipvs_in_vm.py runs this file in a proxy-vm guest",
    ),
]

VIP = "10.96.0.10"


class Driver:
    """A backend in the node's netns, fed one step at a time (ipvs_driver.py)."""

    def __init__(self, topology: Topology, node: Node, mode: str) -> None:
        self.proc = topology.run(
            node,
            [sys.executable, str(DRIVER), mode, node.name, node.ipv4],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def step(self, **step: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(step) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self.proc.stdout.readline())
        assert answer["ok"], answer
        return answer


def web(b1: Pod, b2: Pod | None = None, **extra: Any) -> dict[str, Any]:
    endpoints = [[b1.ipv4, 8080, True]] + ([[b2.ipv4, 8080]] if b2 else [])
    return {
        "key": ["d", "web", "tcp"],
        "port": 80,
        "cluster_ips": [VIP],
        "endpoints": endpoints,
        "node_port": 30080,
        **extra,
    }


def dns(b1: Pod, b2: Pod) -> dict[str, Any]:
    return {
        "key": ["d", "dns", "udp"],
        "port": 53,
        "cluster_ips": [VIP],
        "endpoints": [[b1.ipv4, 8080, True], [b2.ipv4, 8080]],
    }


NONE = {"key": ["d", "none", "tcp"], "port": 81, "cluster_ips": [VIP]}


def ipvsadm(topology: Topology, node: Node, *args: str) -> str:
    return topology.exec(node, ["ipvsadm", *args], check=True).stdout


def setup(topology: Topology) -> tuple[Node, Node, Pod, Pod, Pod]:
    n1, n2 = topology.add_node("n1"), topology.add_node("n2")
    b1, b2 = topology.add_pod(n1, "b1"), topology.add_pod(n2, "b2")
    client = topology.add_pod(n1, "client")
    for pod in (b1, b2):
        topology.run_ready(
            pod,
            topology.python_argv("kpx_cluster.echo_server", "--name", pod.name, "--port", "8080"),
        )
    return n1, n2, b1, b2, client


def test_cluster_ip_tcp_udp_node_port_and_no_endpoints(topology: Topology) -> None:
    n1, n2, b1, b2, client = setup(topology)
    driver = Driver(topology, n1, "ipvs")
    driver.step(services=[web(b1, b2), dns(b1, b2), NONE])
    listing = ipvsadm(topology, n1, "-Ln")
    # NAT forwarding ("Masq"), round robin, the VIP and the NodePort on the node's address.
    assert f"TCP  {VIP}:80 rr" in listing and f"{b2.ipv4}:8080" in listing
    assert "Masq" in listing and "Route" not in listing
    assert f"TCP  {n1.ipv4}:30080 rr" in listing
    assert VIP in topology.exec(n1, ["ip", "-4", "addr", "show", "kube-ipvs0"]).stdout
    tcp = probe(topology, client, VIP, 80, "tcp", count=20, timeout=2)
    assert tcp.backends == {"b1", "b2"} and tcp.failed == 0, tcp
    udp = probe(topology, client, VIP, 53, "udp", count=20, timeout=2)
    assert udp.backends == {"b1", "b2"}, udp
    # A pod on the other node reaches the NodePort on n1's address.
    other = topology.add_pod(n2, "other")
    nodeport = probe(topology, other, n1.ipv4, 30080, "tcp", count=10, timeout=2)
    assert nodeport.backends <= {"b1", "b2"} and nodeport.failed == 0, nodeport
    # No endpoints: rejected at once (IPVS answers port unreachable), as the other modes.
    none = probe(topology, client, VIP, 81, "tcp", count=2, timeout=2)
    assert none.refused == 2, none


def test_affinity_scheduler_timeouts_and_strict_arp(topology: Topology) -> None:
    n1, _n2, b1, b2, client = setup(topology)
    driver = Driver(topology, n1, "ipvs")
    settings = {
        "scheduler": "wlc",
        "strict_arp": True,
        "tcp_timeout": 901,
        "tcp_fin_timeout": 121,
        "udp_timeout": 301,
    }
    driver.step(services=[web(b1, b2, affinity=600)], settings=settings)
    listing = ipvsadm(topology, n1, "-Ln")
    assert f"TCP  {VIP}:80 wlc persistent 600" in listing, listing
    assert "901 121 301" in " ".join(ipvsadm(topology, n1, "-Ln", "--timeout").split()[-3:])
    sysctl = topology.exec(
        n1, ["sysctl", "-n", "net.ipv4.conf.all.arp_ignore", "net.ipv4.conf.all.arp_announce"]
    ).stdout.split()
    assert sysctl == ["1", "2"]
    sticky = probe(topology, client, VIP, 80, "tcp", count=12, timeout=2)
    assert len(sticky.backends) == 1 and sticky.failed == 0, sticky


@pytest.mark.parametrize("affinity", [0, 600], ids=["no-affinity", "client-ip-affinity"])
def test_a_node_port_from_another_nodes_pod_reaches_an_endpoint_on_either_node(
    topology: Topology, affinity: int
) -> None:
    """A pod on n2 dials n1's NodePort; n1 sends it to the one endpoint, on n1 (b1) or back on
    the client's node n2 (b2: only n1's masquerade brings the answer back through n1), with and
    without session affinity (a persistent virtual server: Conformance's "switch session
    affinity for NodePort service" sticks to one endpoint, so a broken path never heals)."""
    n1, n2, b1, b2, _client = setup(topology)
    drivers = [Driver(topology, n, "ipvs") for n in (n1, n2)]
    other = topology.add_pod(n2, "other")
    for endpoint in (b1, b2):
        for driver in drivers:
            driver.step(services=[web(endpoint, affinity=affinity)])
        seen = probe(topology, other, n1.ipv4, 30080, "tcp", count=4, timeout=2)
        assert seen.backends == {endpoint.name} and seen.failed == 0, (endpoint.name, seen)


def test_spec_ipvs_masquerade_all_masquerades_a_local_pods_traffic(topology: Topology) -> None:
    """spec.ipvs.masqueradeAll, resolved from the API as the agent does: without it a pod of
    the cluster CIDR keeps its source address to a cluster IP; with it, it is masqueraded."""
    n1, _n2, b1, _b2, client = setup(topology)
    driver = Driver(topology, n1, "ipvs")
    for masquerade_all in (False, True):
        spec = {
            "clusterCIDRs": ["10.244.0.0/16"],
            "ipvs": {"acknowledgeDeprecation": True, "masqueradeAll": masquerade_all},
        }
        driver.step(services=[web(b1)], settings={"spec": spec})
        seen = probe(topology, client, VIP, 80, "tcp", count=6, timeout=2)
        assert seen.backends == {"b1"} and seen.failed == 0, seen
        sources = {s for per in seen.sources.values() for s in per}
        if masquerade_all:
            assert sources and client.ipv4 not in sources, seen
        else:
            assert sources == {client.ipv4}, seen


def test_internal_traffic_policy_local_without_local_endpoint_drops(topology: Topology) -> None:
    n1, _n2, _b1, _b2, client = setup(topology)
    driver = Driver(topology, n1, "ipvs")
    driver.step(services=[{**NONE, "drop": True}])
    dropped = probe(topology, client, VIP, 81, "tcp", count=1, timeout=2)
    assert dropped.timeout == 1 and dropped.refused == 0, dropped


def test_removed_endpoint_drains_then_leaves_and_only_changes_are_sent(
    topology: Topology,
) -> None:
    n1, _n2, b1, b2, client = setup(topology)
    driver = Driver(topology, n1, "ipvs")
    driver.step(services=[web(b1, b2), NONE], settings={"tcp_fin_timeout": 20})
    # One long-lived connection to b2 (held open from the client pod).
    holder = topology.run(
        client,
        [sys.executable, "-c", HOLD_TO_B2.format(vip=VIP)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "b2"
    answer = driver.step(
        services=[web(b1), NONE], changed=[["d", "web", "tcp"]], settings={"tcp_fin_timeout": 20}
    )
    # b2 behind the VIP drains (a connection); behind the NodePort it had none: gone at once.
    assert answer["draining"] == 1, answer
    listing = ipvsadm(topology, n1, "-Ln")
    b2_lines = [line for line in listing.splitlines() if b2.ipv4 in line]
    assert b2_lines and all(line.split()[3] == "0" for line in b2_lines), listing  # weight 0
    fresh = probe(topology, client, VIP, 80, "tcp", count=6, timeout=2)
    assert fresh.backends == {"b1"}, fresh
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        step = driver.step(services=[web(b1), NONE], changed=[], settings={"tcp_fin_timeout": 20})
        if step["draining"] == 0:
            break
        time.sleep(1)
    assert b2.ipv4 not in ipvsadm(topology, n1, "-Ln")


HOLD_TO_B2 = """
import socket, time
while True:
    s = socket.create_connection(("{vip}", 80), timeout=2)
    s.sendall(b"x\\n")
    name = s.recv(100).split()[0].decode()
    if name == "b2":
        print(name, flush=True)
        time.sleep(300)
    s.close()
"""


@pytest.mark.parametrize("successor", ["nftables", "iptables"])
def test_another_mode_taking_over_keeps_traffic_and_leaves_nothing(
    topology: Topology, successor: str
) -> None:
    n1, _n2, b1, b2, client = setup(topology)
    ipvs = Driver(topology, n1, "ipvs")
    services = [web(b1, b2), NONE]
    ipvs.step(services=services)
    assert probe(topology, client, VIP, 80, "tcp", count=4, timeout=2).failed == 0
    # The successor's agent starts on the node: it programs its rules, then removes ipvs's.
    other = Driver(topology, n1, successor)
    other.step(remove_other_modes=True, services=services)
    assert "TCP" not in ipvsadm(topology, n1, "-Ln")
    assert "kube-ipvs0" not in topology.exec(n1, ["ip", "link", "show"]).stdout
    assert "kpx-ipvs" not in topology.exec(n1, ["nft", "list", "tables"]).stdout
    # The successor picks endpoints at random: 30 tries all on one backend happens 2 in 2**30
    # runs (with 10, 2 in 1,024).
    after = probe(topology, client, VIP, 80, "tcp", count=30, timeout=2)
    assert after.backends == {"b1", "b2"} and after.failed == 0, after


def test_proxy_agent_cleanup_removes_every_ipvs_rule(topology: Topology) -> None:
    n1, _n2, b1, b2, _client = setup(topology)
    Driver(topology, n1, "ipvs").step(services=[web(b1, b2), NONE])
    assert "TCP" in ipvsadm(topology, n1, "-Ln")
    result = topology.exec(
        n1, [sys.executable, "-m", "kpx_agent.cli", "cleanup", "--mode", "ipvs"], timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "TCP" not in ipvsadm(topology, n1, "-Ln")
    assert "kube-ipvs0" not in topology.exec(n1, ["ip", "link", "show"]).stdout
    assert "kpx-ipvs" not in topology.exec(n1, ["nft", "list", "tables"]).stdout


def test_exclude_cidrs_are_left_alone_by_a_full_sync(topology: Topology) -> None:
    n1, _n2, b1, b2, _client = setup(topology)
    # Someone else's virtual servers: one inside excludeCIDRs, one outside.
    ipvsadm(topology, n1, "-A", "-t", "192.168.50.1:80")
    ipvsadm(topology, n1, "-A", "-t", "192.168.60.1:80")
    driver = Driver(topology, n1, "ipvs")
    driver.step(services=[web(b1, b2)], settings={"exclude_cidrs": ["192.168.50.0/24"]})
    listing = ipvsadm(topology, n1, "-Ln")
    assert "192.168.50.1:80" in listing and "192.168.60.1:80" not in listing


SCTP_SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8080))
s.listen(16)
print("ready", flush=True)
while True:
    conn, peer = s.accept()
    conn.sendall(sys.argv[1].encode() + b" " + peer[0].encode())
    conn.close()
"""

SCTP_CLIENT = """
import collections, json, socket, sys
seen = collections.Counter()
for _ in range(int(sys.argv[3])):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
    s.settimeout(10)  # SCTP resends an INIT after 3 s (rto_initial): one loss must not fail
    try:
        s.connect((sys.argv[1], int(sys.argv[2])))
        seen[s.recv(100).decode().split()[0]] += 1
    except OSError as exc:
        seen[type(exc).__name__] += 1
    finally:
        s.close()
print(json.dumps(seen))
"""


def test_sctp_virtual_server_carries_associations_to_both_endpoints(topology: Topology) -> None:
    n1, _n2, b1, b2, client = setup(topology)
    for pod in (b1, b2):
        server = topology.run(
            pod, [sys.executable, "-c", SCTP_SERVER, pod.name], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    driver = Driver(topology, n1, "ipvs")
    sctp = {
        "key": ["d", "sctp", "sctp"],
        "port": 9,
        "cluster_ips": [VIP],
        "endpoints": [[b1.ipv4, 8080, True], [b2.ipv4, 8080]],
    }
    driver.step(services=[sctp])
    listing = ipvsadm(topology, n1, "-Ln")
    assert f"SCTP {VIP}:9 rr" in " ".join(listing.split()) and "Masq" in listing, listing
    run = topology.exec(client, [sys.executable, "-c", SCTP_CLIENT, VIP, "9", "8"], timeout=120)
    seen = json.loads(run.stdout.strip() or "{}")
    assert set(seen) == {"b1", "b2"} and sum(seen.values()) == 8, (seen, run.stderr)
    # A removed SCTP endpoint leaves at once (no graceful drain, as upstream: TCP only).
    answer = driver.step(
        services=[{**sctp, "endpoints": [[b1.ipv4, 8080, True]]}], changed=[["d", "sctp", "sctp"]]
    )
    assert answer["draining"] == 0 and b2.ipv4 not in ipvsadm(topology, n1, "-Ln")


# ---- what ipvs mode does differently (documented in backends/ipvs/README.md) ----------------


def test_documented_differences_of_ipvs_mode(topology: Topology) -> None:
    n1, _n2, b1, b2, client = setup(topology)
    driver = Driver(topology, n1, "ipvs")
    # externalTrafficPolicy Local with its only endpoint on n2: from a pod of n1 the NodePort
    # gets no short circuit to n2's endpoint (nftables and iptables modes send it there).
    local = {
        "key": ["d", "local", "tcp"],
        "port": 82,
        "cluster_ips": ["10.96.0.11"],
        "endpoints": [[b2.ipv4, 8080]],
        "external": [],
        "node_port": 30082,
        "external_masquerade": False,
        "drop_external": True,
    }
    driver.step(services=[web(b1, b2), local])
    no_short_circuit = probe(topology, client, n1.ipv4, 30082, "tcp", count=1, timeout=2)
    assert no_short_circuit.answered == 0, no_short_circuit
    # 1. A Service IP is bound to kube-ipvs0: the node itself answers on ports no Service has
    #    (refused by its own stack), where the other modes have no such address at all.
    other_port = probe(topology, client, VIP, 9999, "tcp", count=1, timeout=2)
    assert other_port.refused == 1, other_port
    # 2. No localhost NodePorts (iptables.localhostNodePorts has no ipvs counterpart).
    localhost = probe(topology, n1, "127.0.0.1", 30080, "tcp", count=1, timeout=2)
    assert localhost.answered == 0, localhost
    # 3. Every real server has weight 1 (the scheduler balances; topology hints only filter).
    weights = {
        line.split()[3]
        for line in ipvsadm(topology, n1, "-Ln").splitlines()
        if line.strip().startswith("->") and "Masq" in line
    }
    assert weights == {"1"}
