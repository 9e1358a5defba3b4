"""The agent's UDP conntrack cleanup at its start keeps live flows (issue #18, found under load).

At an agent's first sync every UDP Service port goes from "nothing known" to its endpoints, and
the stale-entry cleanup for "no endpoints -> some" runs for all of them (a mode switch, an
upgrade, a restart). It must delete the entries that were not DNATed (made while the Service
was unrouted or rejected: they blackhole their socket) and keep the flows DNATed to a serving
endpoint. In a node's netns: a ClusterIP DNATed to a backend on another node that answers 1 s
after each request; the cleanup runs while a request is in flight; the answer must arrive, and
a not-DNATed entry to the same ClusterIP must be gone. The former filter (every entry to the
ClusterIP) loses the answer: the control that shows the setup can tell. The deletions are the
agent's (netlink, `conntrack.delete_flows`); the `conntrack` tool only lists and inserts.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kpx_agent.conntrack import stale_flows as conntrack
from kpx_agent.conntrack.stale_flows import FlowFilter, stale_flows
from kpx_agent.model.types import IP, Endpoint, Protocol, ServicePort, ServicePortKey
from kpx_cluster.netns import Node, Pod, Topology, call_in_netns

pytestmark = [pytest.mark.netns]

VIP, PORT, BACKEND_PORT, NODE_PORT = "10.96.0.53", 53, 5353, 30053

SLOW_SERVER = """
import socket, sys, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
def answer(data, addr):
    time.sleep(1.0)
    s.sendto(b"answer " + data, addr)
while True:
    data, addr = s.recvfrom(512)
    threading.Thread(target=answer, args=(data, addr), daemon=True).start()
"""

ONE_EXCHANGE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(4)
s.connect((sys.argv[1], int(sys.argv[2])))
s.send(b"q")
try:
    print(s.recv(512).decode(), flush=True)
except OSError as exc:
    print("lost", type(exc).__name__, flush=True)
"""

DNAT = """table ip kpx-ct-test {{
  chain pre {{
    type nat hook prerouting priority -100; policy accept;
    ip daddr {vip} udp dport {port} dnat to {backend}:{backend_port}
  }}
}}
"""


@pytest.fixture(scope="module")
def net() -> Iterator[tuple[Topology, Node, Pod, Pod]]:
    with Topology() as topo:
        n1, n2 = topo.add_node("n1"), topo.add_node("n2")
        client, backend = topo.add_pod(n1, "client"), topo.add_pod(n2, "backend")
        rules = DNAT.format(vip=VIP, port=PORT, backend=backend.ipv4, backend_port=BACKEND_PORT)
        topo.exec(n1, ["nft", "-f", "-"], input=rules, check=True)
        topo.run_ready(backend, [sys.executable, "-c", SLOW_SERVER, str(BACKEND_PORT)])
        yield topo, n1, client, backend


def _cleanup_at_start(backend: Pod) -> list[FlowFilter]:
    """What the agent's first sync deletes for a UDP Service port with one endpoint."""
    port = ServicePort(
        ServicePortKey("kube-system", "dns", "dns", Protocol.UDP, 4),
        PORT,
        cluster_ips=(IP.of(VIP),),
        node_port=NODE_PORT,
        cluster_endpoints=(Endpoint(IP.of(backend.ipv4), BACKEND_PORT),),
        external_endpoints=(Endpoint(IP.of(backend.ipv4), BACKEND_PORT),),
    )
    return stale_flows(None, port)


def _exchange_with_cleanup(topo: Topology, n1: Node, client: Pod, filters: list[FlowFilter]) -> str:
    """One request in flight while `filters` run in n1; what the client got."""
    proc = topo.run(
        client,
        [sys.executable, "-c", ONE_EXCHANGE, VIP, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.4)  # the request is DNATed and waits for its answer
    entries = topo.exec(n1, ["conntrack", "-L", "-p", "udp", "--orig-dst", VIP]).stdout
    assert f"src={client.ipv4}" in entries, f"no entry for the request: {entries}"
    assert call_in_netns(n1.netns, lambda: conntrack.delete_flows(filters)) == 0
    out, _ = proc.communicate(timeout=10)
    return out.strip()


def test_cleanup_at_agent_start_keeps_dnated_flows_and_deletes_the_others(
    net: tuple[Topology, Node, Pod, Pod],
) -> None:
    topo, n1, client, backend = net
    # An entry made while the Service was unrouted: not DNATed, its reply "from" the VIP.
    topo.exec(
        n1,
        [
            "conntrack",
            "-I",
            "-p",
            "udp",
            "-s",
            client.ipv4,
            "-d",
            VIP,
            "--sport",
            "40000",
            "--dport",
            str(PORT),
            "--reply-src",
            VIP,
            "--reply-dst",
            client.ipv4,
            "--reply-port-src",
            str(PORT),
            "--reply-port-dst",
            "40000",
            "-t",
            "60",
        ],
        check=True,
    )
    filters = _cleanup_at_start(backend)
    assert all(f.not_nated for f in filters) and len(filters) == 2, filters

    assert _exchange_with_cleanup(topo, n1, client, filters) == "answer q"
    left = topo.exec(n1, ["conntrack", "-L", "-p", "udp", "--orig-dst", VIP]).stdout
    assert "sport=40000" not in left, f"the not-DNATed entry stayed: {left}"


def test_the_former_filter_loses_the_answer_in_flight(
    net: tuple[Topology, Node, Pod, Pod],
) -> None:
    """The control: deleting every entry to the ClusterIP drops the reply's reverse NAT."""
    topo, n1, client, _ = net
    everything = [FlowFilter(4, PORT, IP.of(VIP))]
    assert _exchange_with_cleanup(topo, n1, client, everything).startswith("lost")


SEND_FROM = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[3])))
s.sendto(b"q", (sys.argv[1], int(sys.argv[2])))
"""

OTHER_TARGET_PORT = """table ip kpx-ct-port {{
  chain pre {{
    type nat hook prerouting priority -101; policy accept;
    ip daddr {vip} udp dport {port} udp sport {sport} dnat to {backend}:{backend_port}
  }}
}}
"""


def test_target_port_change_deletes_only_the_entries_to_the_old_port(
    net: tuple[Topology, Node, Pod, Pod],
) -> None:
    """The same pod, its targetPort changed from 5353 to 6363: the entry DNATed to :5353 goes
    (the client would keep sending to the old port until it expires), one DNATed to :6363
    stays. Real DNATed entries: the client sends from port 41000 (DNATed to :5353 by the
    module's rule) and from 41001 (DNATed to :6363 by a rule of this test)."""
    topo, n1, client, backend = net
    rules = OTHER_TARGET_PORT.format(
        vip=VIP, port=PORT, sport=41001, backend=backend.ipv4, backend_port=6363
    )
    topo.exec(n1, ["nft", "-f", "-"], input=rules, check=True)
    try:
        for sport in (41000, 41001):
            topo.exec(
                client, [sys.executable, "-c", SEND_FROM, VIP, str(PORT), str(sport)], check=True
            )

        def port(target: int) -> ServicePort:
            ep = Endpoint(IP.of(backend.ipv4), target)
            key = ServicePortKey("kube-system", "dns", "dns", Protocol.UDP, 4)
            return ServicePort(
                key,
                PORT,
                cluster_ips=(IP.of(VIP),),
                cluster_endpoints=(ep,),
                external_endpoints=(ep,),
            )

        before = topo.exec(n1, ["conntrack", "-L", "-p", "udp", "--orig-dst", VIP]).stdout
        assert "sport=41000" in before and "sport=41001" in before, before
        filters = stale_flows(port(BACKEND_PORT), port(6363))
        assert call_in_netns(n1.netns, lambda: conntrack.delete_flows(filters)) == 0
        left = topo.exec(n1, ["conntrack", "-L", "-p", "udp", "--orig-dst", VIP]).stdout
        assert "sport=41000 " not in left, f"the entry to the old target port stayed: {left}"
        assert "sport=41001 " in left, f"the entry to the new target port went too: {left}"
    finally:
        topo.exec(n1, ["nft", "delete", "table", "ip", "kpx-ct-port"])


NODE_PORT_RULES = """table ip kpx-ct-np {{
  chain pre {{
    type nat hook prerouting priority -101; policy accept;
    udp dport {node_port} dnat to {backend}:{backend_port}
  }}
}}
"""
OTHER_VIP = "10.96.0.99"  # another UDP Service's ClusterIP, on the NodePort's port number


def test_reconcile_at_start_deletes_only_entries_dnated_to_an_endpoint_no_longer_serving(
    net: tuple[Topology, Node, Pod, Pod],
) -> None:
    """Real entries DNATed to the backend: to the ClusterIP (the client sends from port
    42000), to the NodePort on n1's address (42001) and to another Service's ClusterIP on the
    NodePort's port number (42002). The agent's start-up reconcile keeps the first two while
    the backend is a serving endpoint of the port, and deletes them once the port's serving
    endpoints are others (the pod went away while no agent ran); the third is the other
    Service's and stays."""
    topo, n1, client, backend = net
    rules = NODE_PORT_RULES.format(
        node_port=NODE_PORT, backend=backend.ipv4, backend_port=BACKEND_PORT
    )
    topo.exec(n1, ["nft", "-f", "-"], input=rules, check=True)
    try:
        for dst, dport, sport in (
            (VIP, PORT, 42000),
            (n1.ipv4, NODE_PORT, 42001),
            (OTHER_VIP, NODE_PORT, 42002),
        ):
            topo.exec(
                client, [sys.executable, "-c", SEND_FROM, dst, str(dport), str(sport)], check=True
            )

        def entries() -> str:
            return topo.exec(n1, ["conntrack", "-L", "-p", "udp"]).stdout.replace(
                "[UNREPLIED] ", ""
            )

        for sport in (42000, 42001, 42002):
            assert f"sport={sport} " in entries() and f"src={backend.ipv4} " in entries(), entries()
        port = ServicePort(
            ServicePortKey("kube-system", "dns", "dns", Protocol.UDP, 4),
            PORT,
            cluster_ips=(IP.of(VIP),),
            node_port=NODE_PORT,
        )
        other = ServicePort(
            ServicePortKey("kube-system", "other", "", Protocol.UDP, 4),
            NODE_PORT,
            cluster_ips=(IP.of(OTHER_VIP),),
        )
        addresses = conntrack.udp_addresses_by_port([port, other])

        def reconcile(serving: set[str]) -> None:
            filters = conntrack.reconcile_flows(port, frozenset(serving), addresses)
            assert call_in_netns(n1.netns, lambda: conntrack.delete_flows(filters)) == 0

        reconcile({backend.ipv4})
        for sport in (42000, 42001, 42002):
            assert f"sport={sport} " in entries(), f"a serving endpoint's entry went: {entries()}"
        reconcile({"10.244.99.99"})
        for sport in (42000, 42001):
            assert f"sport={sport} " not in entries(), (
                f"a gone endpoint's entry stayed: {entries()}"
            )
        assert "sport=42002 " in entries(), f"the other Service's entry went: {entries()}"
    finally:
        topo.exec(n1, ["nft", "delete", "table", "ip", "kpx-ct-np"])
