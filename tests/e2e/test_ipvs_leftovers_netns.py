"""Issue #18: another kpx mode's agent removes only what a kpx ipvs agent made, in a real
node netns (real nftables tables, real kube-ipvs0 and its addresses, real iptables chains).

This kernel has no ip_vs module, so the virtual servers are a recording stand-in for IPVS's
netlink socket (the IPVS calls themselves are covered by the guest's test_ipvs_kernel.py), and
no dummy link type, so kube-ipvs0 is a veth; all else is the node's kernel. Three nodes: one a
kpx ipvs agent left (its helper table with the elements its real rendering writes), one
upstream kube-proxy's ipvs mode runs on (the same virtual servers on kube-ipvs0, its
KUBE-IPVS-FILTER chain, no kpx table), one with both.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from kpx_cluster.netns import Topology

pytestmark = pytest.mark.netns

SCENARIO = """
import json, subprocess, sys
from kpx_agent.backends.ipvs import kernel
from kpx_agent.backends.ipvs.model import VirtualKey, plan_port
from kpx_agent.backends.ipvs.ruleset import base_table
from kpx_agent.model.service_ports import node_facts
from kpx_agent.backends.ipvs.leftover_removal import remove_kpx_ipvs_leftovers
from kpx_agent.handover.from_kube_proxy import kube_proxy_ipvs_mode_here
from kpx_agent.model.types import *

kpx, kube_proxy, busy = json.loads(sys.argv[1])
state = {"drained": False}
node = NodeInfo("n1", (IP.of("192.168.1.10"),))
settings = DataplaneSettings()
ep = Endpoint(IP.of("10.244.1.5"), 8080, True)
def port(name, **f):
    return ServicePort(ServicePortKey("d", name, "", Protocol.TCP, 4), 80, **f)
ports = [
    port("web", cluster_ips=(IP.of("10.96.0.10"),), cluster_endpoints=(ep,),
         external_endpoints=(ep,), node_port=30080),
    port("local", cluster_ips=(IP.of("10.96.0.11"),), cluster_endpoints=(ep,),
         external_endpoints=(ep,), node_port=30081, external_masquerade=False,
         load_balancer_ips=(IP.of("203.0.113.7"),)),
]
plans = [plan_port(p, node, settings) for p in ports]
servers = {k: sorted(v.real_servers) for p in plans for k, v in p.virtual_servers.items()}
servers[VirtualKey(4, "tcp", "192.168.60.1", 80)] = [("192.168.60.20", 80)]  # someone's
# This kernel has no dummy link type: kube-ipvs0 is a veth here (found and removed by name).
subprocess.run(["ip", "link", "add", "kube-ipvs0", "type", "veth", "peer", "name", "kipvs0p"],
               check=True)
kernel.bind([(True, 4, a) for p in plans for _f, a in p.bound])
if kpx:
    elements = {}
    for p in plans:
        for name, members in p.elements.items():
            elements.setdefault(name, set()).update(members)
    kernel.run_nft(base_table(settings, node_facts(settings, node)[4], elements))
if kube_proxy:
    subprocess.run(["iptables-restore", "--noflush"], check=True, text=True,
                   input="*filter\\n:KUBE-IPVS-FILTER - [0:0]\\nCOMMIT\\n")

# Stands in for kernel.Ipvs (no ip_vs here): the same methods, deletions recorded and
# counted as sent only by flush, as the real one queues them.
class RecordingIpvs:
    deleted, queued = [], []
    def services(self): return iter(list(servers))
    def real_servers(self, key):
        conns = 3 if key.address == busy and not state["drained"] else 0
        return {s: RealServer(1, conns, conns) for s in servers[key]}
    def delete_service(self, key): self.queued.append(key)
    def flush(self):
        self.deleted.extend(self.queued)
        for key in self.queued:
            servers.pop(key)
        self.queued.clear()
    def close(self): self.queued.clear()

from kpx_agent.backends.ipvs.kernel import Ipvs, RealServer
missing = [m for m, v in vars(RecordingIpvs).items()
           if callable(v) and not callable(getattr(Ipvs, m, None))]
assert not missing, f"the stand-in has methods the real Ipvs lacks: {missing}"

def seen():
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return links, tables

from kpx_agent.handover.make_before_break import Draining
kpx_servers = sorted(f"{k.protocol}/{k.address}:{k.port}" for k in servers
                     if not k.address.startswith("192.168.60."))
fake = RecordingIpvs()
draining = None
try:
    remove_kpx_ipvs_leftovers((), kube_proxy_ipvs_mode_here, open_ipvs=lambda: fake)
except Draining as exc:  # connections through one: the rest goes, it stays (with the mark)
    links, tables = seen()
    draining = {"why": str(exc), "deleted": sorted(f"{k.address}:{k.port}" for k in fake.deleted),
                "dummy": "kube-ipvs0" in links, "kpx_table": "kpx-ipvs" in tables}
    state["drained"] = True  # they ended: the next try takes the rest
    remove_kpx_ipvs_leftovers((), kube_proxy_ipvs_mode_here, open_ipvs=lambda: fake)
links, tables = seen()
print(json.dumps({
    "draining": draining,
    "kpx": kpx_servers,
    "deleted": sorted(f"{k.protocol}/{k.address}:{k.port}" for k in fake.deleted),
    "dummy": "kube-ipvs0" in links, "kpx_table": "kpx-ipvs" in tables,
}))
"""


def run(
    topology: Topology, name: str, kpx: bool, kube_proxy: bool, busy: str = ""
) -> dict[str, Any]:
    node = topology.add_node(name)
    args = json.dumps([kpx, kube_proxy, busy])
    result = topology.exec(node, [sys.executable, "-c", SCENARIO, args], timeout=60)
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return out


def test_a_kpx_ipvs_agents_state_goes_and_nobody_elses(topology: Topology) -> None:
    out = run(topology, "n1", kpx=True, kube_proxy=False)
    # Every virtual server kpx made (cluster IPs, the NodePorts - also the ETP Local one no
    # helper set names - and the load-balancer IP), not someone's on 192.168.60.1.
    assert out["deleted"] == out["kpx"] and "tcp/192.168.1.10:30081" in out["deleted"], out
    assert out["dummy"] is False and out["kpx_table"] is False, out


def test_upstream_kube_proxys_ipvs_state_is_left_for_the_takeover(topology: Topology) -> None:
    out = run(topology, "n1", kpx=False, kube_proxy=True)
    assert out["deleted"] == [] and out["dummy"] is True, out


def test_with_kube_proxys_ipvs_mode_on_the_node_only_kpxs_table_goes(topology: Topology) -> None:
    out = run(topology, "n1", kpx=True, kube_proxy=True)
    assert out["deleted"] == [] and out["dummy"] is True and out["kpx_table"] is False, out


def test_a_virtual_server_with_connections_drains_before_it_goes(topology: Topology) -> None:
    """IPVS still carries connections through kpx's 10.96.0.10:80 (established before the new
    mode's rules took new ones): it stays, with kube-ipvs0 and the kpx-ipvs table (the mark a
    later try needs), the rest goes; once its connections ended, the next try takes it all."""
    out = run(topology, "n1", kpx=True, kube_proxy=False, busy="10.96.0.10")
    draining = out["draining"]
    assert draining is not None, out
    assert "still carry established connections" in draining["why"], draining
    assert "10.96.0.10:80" not in draining["deleted"] and "10.96.0.11:80" in draining["deleted"]
    assert draining["dummy"] is True and draining["kpx_table"] is True, draining
    assert out["deleted"] == out["kpx"] and out["dummy"] is False and not out["kpx_table"], out
