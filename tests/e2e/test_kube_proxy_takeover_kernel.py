"""Issue #18, taking a node over from upstream kube-proxy, in a real kernel (node n1's netns).

kpx's nftables backend serves a ClusterIP on n1 (driven in-process, as the agent's sync does).
Upstream kube-proxy's rules are loaded beside it, shaped as kube-proxy writes them: its
iptables chains and jumps in IPv4 through the legacy iptables and in IPv6 through the
nf_tables one (either variant may hold them), and its `ip`/`ip6 kube-proxy` nftables tables.
Foreign rules are there too: the kubelet's KUBE-FIREWALL, a CNI's hostport chain that jumps
into kube-proxy's KUBE-MARK-MASQ, a site chain, and a foreign nftables table. While a client
opens a new connection to the ClusterIP every 10 ms, the takeover cleanup runs: afterwards
nothing of kube-proxy's remains, every foreign rule does, and no try failed.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_harness import TrafficWatch, iptables_chains

from kpx_cluster.netns import Node, Pod, Topology

pytestmark = pytest.mark.netns
VIP = "10.96.0.10"

SERVE = """
import json, sys
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent import backends
spec = json.loads(sys.argv[1])
ip = IP.of
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),))
port = ServicePort(ServicePortKey("d", "web", "", Protocol.TCP, 4), 80,
                   cluster_ips=(ip(spec["vip"]),),
                   cluster_endpoints=(Endpoint(ip(spec["b1"]), 8080, True),))
backend = backends.load("nftables").create(settings)
backend.sync(local_state(NodeInfo("n1", (ip(spec["n1"]),)), settings, [port]), None)
assert backend.programmed()
print("synced")
"""

TAKEOVER = """
from kpx_agent.handover.from_kube_proxy import remove_kube_proxy_leftovers
remove_kube_proxy_leftovers(include_ipvs=False)
print("done")
"""

# Upstream's iptables mode (v1.36), trimmed to one Service ({vip} and {b1} filled in), with the
# kubelet's, a CNI's and a site's chains beside it.
UPSTREAM_V4 = (Path(__file__).parent / "kube_proxy_rules" / "upstream-v4.rules").read_text()

UPSTREAM_NAT_V6 = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-BBBBBBBBBBBBBBBB - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES -d fd00:96::10/128 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-BBBBBBBBBBBBBBBB
-A KUBE-SEP-BBBBBBBBBBBBBBBB -p tcp -m tcp -j DNAT --to-destination [fd00:244:1::2]:8080
COMMIT
*filter
:KUBE-KUBELET-CANARY - [0:0]
COMMIT
"""

# Upstream's nftables mode keeps everything in its own tables; a foreign table stays.
UPSTREAM_NFT = """
table ip kube-proxy {
    chain nat-prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        jump services
    }
    chain services {
        ip daddr 10.96.0.99 tcp dport 80 dnat to 10.244.9.9:80
    }
}
table ip6 kube-proxy {
    chain filter-forward {
        type filter hook forward priority -110; policy accept;
    }
}
table inet site {
    chain input {
        type filter hook input priority 0; policy accept;
        tcp dport 2222 accept
    }
}
"""


@dataclass
class Node1:
    topo: Topology
    n1: Node
    client: Pod

    def sh(self, *argv: str, stdin: str | None = None) -> str:
        return self.topo.exec(self.n1, list(argv), check=True, input=stdin).stdout

    def chains(self, tool: str) -> set[str]:
        out: set[str] = set()
        table = ""
        for line in self.sh(tool).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                out.add(f"{table} {line[1:].split()[0]}")
        return out

    def rules(self, tool: str) -> list[str]:
        return [line for line in self.sh(tool).splitlines() if line.startswith("-A ")]


@pytest.fixture
def node(topology: Topology) -> Iterator[Node1]:
    n1, n2 = topology.add_node("n1"), topology.add_node("n2")
    b1 = topology.add_pod(n1, "b1")
    client = topology.add_pod(n2, "client")
    topology.run_ready(
        b1, topology.python_argv("kpx_cluster.echo_server", "--name", "b1", "--port", "8080")
    )
    topology.exec(n2, ["ip", "route", "replace", "10.96.0.0/16", "via", n1.ipv4], check=True)
    here = Node1(topology, n1, client)
    spec = json.dumps({"vip": VIP, "b1": b1.ipv4, "n1": n1.ipv4})
    run = topology.exec(n1, [sys.executable, "-c", SERVE, spec])
    assert run.returncode == 0 and "synced" in run.stdout, run.stderr
    here.sh("iptables-legacy-restore", "--noflush", stdin=UPSTREAM_V4.format(vip=VIP, b1=b1.ipv4))
    here.sh("ip6tables-nft-restore", "--noflush", stdin=UPSTREAM_NAT_V6)
    here.sh("nft", "-f", "-", stdin=UPSTREAM_NFT)
    yield here


def test_takeover_removes_upstreams_rules_only_while_traffic_flows(node: Node1) -> None:
    before_legacy = node.chains("iptables-legacy-save")
    assert "nat KUBE-SVC-ERIFXISQEP7F7OF4" in before_legacy
    assert "nat KUBE-SEP-BBBBBBBBBBBBBBBB" in node.chains("ip6tables-nft-save")
    watch = TrafficWatch.start(node.topo, node.client, VIP, 80)
    try:
        t0 = time.time()
        time.sleep(0.5)
        run = node.topo.exec(node.n1, [sys.executable, "-c", TAKEOVER], timeout=60)
        assert run.returncode == 0 and "done" in run.stdout, run.stderr
        t_done = time.time()
        watch.wait_for(lambda ev: ev[-1][0] if ev and ev[-1][0] > t_done + 1 else None, 10)
    finally:
        watch.stop()
    tries = watch.since(t0)
    failures = [e for e in tries if e[1] != "b1"]
    assert len(tries) > 50 and not failures, f"{len(failures)} of {len(tries)}: {failures[:5]}"

    # Upstream's chains and jumps are gone from both variants and families...
    legacy = node.chains("iptables-legacy-save")
    v6 = node.chains("ip6tables-nft-save")
    upstream = {
        "nat KUBE-SERVICES",
        "nat KUBE-POSTROUTING",
        "nat KUBE-NODEPORTS",
        "nat KUBE-PROXY-CANARY",
        "nat KUBE-SVC-ERIFXISQEP7F7OF4",
        "nat KUBE-SEP-6E7XQMQ4RAYOWTTM",
        "filter KUBE-FORWARD",
        "filter KUBE-SERVICES",
        "filter KUBE-PROXY-FIREWALL",
        "mangle KUBE-PROXY-CANARY",
    }
    assert not (upstream & legacy), upstream & legacy
    assert not {c for c in v6 if c.split()[1].startswith(("KUBE-SVC", "KUBE-SEP", "KUBE-SERV"))}
    assert not [r for r in node.rules("iptables-legacy-save") if "kubernetes service" in r]
    tables = node.sh("nft", "list", "tables")
    assert "kube-proxy" not in tables, tables
    # ...and everyone else's rules stay: the kubelet's, the CNI's (and the kube-proxy chain it
    # still jumps to), the site's, kpx's own table.
    for chain in (
        "filter KUBE-FIREWALL",
        "filter SITE-FILTER",
        "nat CNI-HOSTPORT-DNAT",
        "nat KUBE-MARK-MASQ",
        "mangle KUBE-IPTABLES-HINT",
    ):
        assert chain in legacy, chain
    assert "filter KUBE-KUBELET-CANARY" in v6
    rules = node.rules("iptables-legacy-save")
    assert "-A INPUT -j KUBE-FIREWALL" in rules
    assert "-A INPUT -s 192.0.2.0/24 -j SITE-FILTER" in rules
    assert "-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT" in rules
    assert "table inet site" in tables and "kpx" in tables, tables
    assert not iptables_chains(node.topo, node.n1)  # kpx's iptables mode was never here


IPSETS = """
import json, sys
from pyroute2 import IPSet
s = IPSet()
if sys.argv[1] == "create":
    for name, stype, family in json.loads(sys.argv[2]):
        s.create(name, stype=stype, family=family)
print(json.dumps(sorted(str(m.get_attr("IPSET_ATTR_SETNAME")) for m in s.list())))
s.close()
"""

# kube-proxy's ipvs mode: its sets, used by its own chains (one of them also by a site's rule);
# beside them a CNI's set and one named like kube-proxy's that is not one of its names.
IPVS_MODE_RULES = """*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODE-PORT - [0:0]
:SITE-NAT - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-SERVICES -m set --match-set KUBE-NODE-PORT-TCP dst -j KUBE-NODE-PORT
-A SITE-NAT -m set --match-set KUBE-LOOP-BACK dst,dst,src -j ACCEPT
COMMIT
"""


def test_takeover_destroys_kube_proxys_ipsets_only(topology: Topology) -> None:
    n1 = topology.add_node("n1")
    sets = [
        ("KUBE-CLUSTER-IP", "hash:ip,port", 2),
        ("KUBE-6-CLUSTER-IP", "hash:ip,port", 10),
        ("KUBE-NODE-PORT-TCP", "bitmap:port", 2),
        ("KUBE-LOOP-BACK", "hash:ip,port,ip", 2),
        ("KUBE-HEALTH-CHECK-NODE-PORT", "bitmap:port", 2),
        ("cni-hostport", "hash:ip,port", 2),
        ("KUBE-SITE-ALLOWED", "hash:ip", 2),
    ]
    created = topology.exec(
        n1,
        [
            sys.executable,
            "-c",
            IPSETS,
            "create",
            json.dumps([s for s in sets if s[1] != "bitmap:port"]),
        ],
        check=True,
    )
    assert "KUBE-6-CLUSTER-IP" in created.stdout, created
    # bitmap sets need a range: created through pyroute2's lower-level call
    bitmap = (
        "from pyroute2 import IPSet\ns = IPSet()\n"
        "for n in ('KUBE-NODE-PORT-TCP', 'KUBE-HEALTH-CHECK-NODE-PORT'):\n"
        "    s.create(n, stype='bitmap:port', bitmap_ports_range=(0, 65535))\n"
        "s.close()\n"
    )
    topology.exec(n1, [sys.executable, "-c", bitmap], check=True)
    topology.exec(n1, ["iptables-nft-restore", "--noflush"], check=True, input=IPVS_MODE_RULES)

    run = topology.exec(n1, [sys.executable, "-c", TAKEOVER])
    assert run.returncode == 0 and "done" in run.stdout, run.stderr

    left = json.loads(topology.exec(n1, [sys.executable, "-c", IPSETS, "list"], check=True).stdout)
    # kube-proxy's are gone but the one a site's rule still uses; the others' stay
    assert left == ["KUBE-LOOP-BACK", "KUBE-SITE-ALLOWED", "cni-hostport"], left
    rules = topology.exec(n1, ["iptables-nft-save", "-t", "nat"], check=True).stdout
    assert "KUBE-SERVICES" not in rules and "KUBE-NODE-PORT " not in rules, rules
    assert "-A SITE-NAT -m set --match-set KUBE-LOOP-BACK dst,dst,src -j ACCEPT" in rules
