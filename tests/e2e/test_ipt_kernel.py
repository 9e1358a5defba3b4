"""The iptables backend in a real kernel (fresh network namespaces): the golden restore scripts
load, and the backend, driven in-process inside a node's netns, carries real packets: TCP and
UDP to a ClusterIP, rejects, NodePorts, IPv6, affinity, source ranges, hairpin. A restarted
agent takes over without duplicates, and cleanup removes exactly what the backend created."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from kpx_cluster.netns import Node, Topology
from kpx_cluster.probe import probe

pytestmark = pytest.mark.netns
GOLDEN = Path(__file__).resolve().parents[1] / "unit" / "golden" / "iptables"

TOOLS = {
    4: ("iptables", "iptables-save", "iptables-restore"),
    6: ("ip6tables", "ip6tables-save", "ip6tables-restore"),
}
JUMPS = {
    "PREROUTING": "-m comment --comment kpx -j KPX-SERVICES",
    "OUTPUT": "-m comment --comment kpx -j KPX-SERVICES",
    "POSTROUTING": "-m comment --comment kpx -j KPX-POSTROUTING",
    "INPUT": "-m conntrack --ctstate NEW -m comment --comment kpx -j KPX-FILTER",
    "FORWARD": "-m comment --comment kpx -j KPX-FORWARD",
}

# Runs inside n1's netns: argv = step, b1 v4, b2 v4, b1 v6, b2 v6, n1 v4, n1 v6, client v4.
PROGRAM = """
import sys
from ipaddress import ip_network as net
from kpx_agent.model.types import IP
ip = IP.of
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.iptables.backend import IptablesBackend, cleanup
from kpx_agent.backends.iptables.kernel import NodeKernel


class Recording(NodeKernel):
    def __init__(self):
        self.scripts = []

    def restore(self, family, script):
        self.scripts.append((family, script))
        super().restore(family, script)

    def restore_pieces(self, family, pieces):
        text = []

        def reading():
            for piece in pieces:
                text.append(piece)
                yield piece

        try:
            super().restore_pieces(family, reading())
        finally:
            self.scripts.append((family, "".join(text)))


step, b1, b2, b1v6, b2v6, n1, n1v6, client = sys.argv[1:9]
eps = (Endpoint(ip(b1), 8080, True), Endpoint(ip(b2), 8080))
eps6 = (Endpoint(ip(b1v6), 8080, True), Endpoint(ip(b2v6), 8080))

def port(name, proto, family, number, vip, endpoints, **kw):
    key = ServicePortKey("d", name, "", proto, family)
    return ServicePort(key, number, cluster_ips=(ip(vip),), cluster_endpoints=endpoints,
                       external_endpoints=endpoints, **kw)

ports = [
    port("web", Protocol.TCP, 4, 80, "10.96.0.10", eps, node_port=30080),
    port("dns", Protocol.UDP, 4, 53, "10.96.0.10", eps),
    port("none", Protocol.TCP, 4, 81, "10.96.0.10", ()),
    port("none-udp", Protocol.UDP, 4, 82, "10.96.0.10", ()),
    port("web6", Protocol.TCP, 6, 80, "fd00:96::10", eps6),
    port("sticky", Protocol.TCP, 4, 80, "10.96.0.14", eps, affinity_timeout=600),
    port("fw", Protocol.TCP, 4, 80, "10.96.0.15", eps, load_balancer_ips=(ip("192.0.2.30"),),
         load_balancer_source_ranges=(net(client + "/32"),)),
]
late = port("late", Protocol.TCP, 4, 80, "10.96.0.16", eps[1:])
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"), net("fd00:244::/48")))
tools = Recording()
backend = IptablesBackend(settings, tools)
if step == "cleanup":
    cleanup()
else:
    state = local_state(NodeInfo("n1", (ip(n1), ip(n1v6))), settings, ports)
    backend.sync(state, None)
    state.services[late.key] = late
    done = len(tools.scripts)
    backend.sync(state, [late.key])  # a partial sync: the IPv4 nat table only
    partial = tools.scripts[done:]
    assert [(f, s.split()[0]) for f, s in partial] == [(4, "*nat")], partial
    assert backend.last_written == {(4, "nat"): partial[0][1].count("\\n-A ")}, partial
    print("synced", backend.chain_count())
"""


def tool(topo: Topology, node: Node, argv: list[str], script: str | None = None) -> str:
    return topo.exec(node, argv, input=script, check=True).stdout


def saved(topo: Topology, node: Node, family: int) -> str:
    return tool(topo, node, [TOOLS[family][1]])


def test_golden_scripts_load_and_apply_in_order(topology: Topology) -> None:
    n1 = topology.add_node("n1")
    for fam in (4, 6):
        script = (GOLDEN / f"full_sync.v{fam}.rules").read_text()
        tool(topology, n1, [TOOLS[fam][2], "--noflush"], script)
    tool(
        topology,
        n1,
        ["iptables-restore", "--noflush"],
        (GOLDEN / "partial_sync.v4.rules").read_text(),
    )
    v4, v6 = saved(topology, n1, 4), saved(topology, n1, 6)
    svc = "KPX-SVC-ACOEX7XUX4UP242V"
    web = re.findall(rf"^-A {svc} .*$", v4, re.M)  # web is down to one endpoint
    assert web == [
        f"-A {svc} ! -s 10.244.0.0/16 -j KPX-MARK-MASQ",
        f"-A {svc} -p tcp -j DNAT --to-destination 10.244.1.2:8080",
    ], web
    assert "-A KPX-HAIRPIN -s 10.244.1.2/32 -d 10.244.1.2/32 -j KPX-MARK-MASQ" in v4
    assert "--set --name KPX-AFF-S7KJTK4ATEAKBOQF" in v4
    assert "-A KPX-SERVICES -d 10.96.0.12/32 -p tcp -m comment" in v4  # the rest is untouched
    assert "--dport 80 -j KPX-SVC-5GNUIPRP2FT2LFST" in v6
    assert "--to-destination [fd00:244:1::2]:8080" in v6


def test_backend_programs_real_traffic(topology: Topology) -> None:
    n1, n2 = topology.add_node("n1"), topology.add_node("n2")
    b1, b2 = topology.add_pod(n1, "b1"), topology.add_pod(n2, "b2")
    client = topology.add_pod(n1, "client")
    for pod in (b1, b2):
        topology.run_ready(
            pod,
            topology.python_argv("kpx_cluster.echo_server", "--name", pod.name, "--port", "8080"),
        )
    # Someone else's chains and rules, there before the agent: they must survive everything.
    for fam in (4, 6):
        ipt = TOOLS[fam][0]
        for table, builtin in (("nat", "PREROUTING"), ("filter", "INPUT")):
            tool(topology, n1, [ipt, "-t", table, "-N", "FOREIGN"])
            tool(topology, n1, [ipt, "-t", table, "-A", "FOREIGN", "-j", "RETURN"])
            tool(topology, n1, [ipt, "-t", table, "-A", builtin, "-j", "FOREIGN"])
    # Load-balancer IP: routed to n1 from n2; on n1 it leads nowhere unless DNATed.
    tool(topology, n2, ["ip", "route", "add", "192.0.2.0/24", "via", n1.ipv4])
    tool(topology, n1, ["ip", "route", "add", "192.0.2.0/24", "dev", n1.fabric_if])

    args = [b1.ipv4, b2.ipv4, b1.ipv6, b2.ipv6, n1.ipv4, n1.ipv6, client.ipv4]

    def run(step: str) -> None:
        tool(topology, n1, [sys.executable, "-c", PROGRAM, step, *args])

    run("sync")
    tcp = probe(topology, client, "10.96.0.10", 80, "tcp", count=30, timeout=1)
    assert tcp.backends == {"b1", "b2"} and tcp.failed == 0, tcp
    udp = probe(topology, client, "10.96.0.10", 53, "udp", count=30, timeout=1)
    assert udp.backends == {"b1", "b2"} and udp.failed == 0, udp
    for number, proto in ((81, "tcp"), (82, "udp")):
        refused = probe(topology, client, "10.96.0.10", number, proto, count=3, timeout=2)
        assert refused.refused == 3 and refused.timeout == 0, (proto, refused)
    nodeport = probe(topology, n2, n1.ipv4, 30080, "tcp", count=30, timeout=1)
    assert nodeport.backends == {"b1", "b2"} and nodeport.failed == 0, nodeport
    seen = {src for sources in nodeport.sources.values() for src in sources}
    assert n2.ipv4 not in seen, f"external traffic must be masqueraded: {nodeport.sources}"
    v6 = probe(topology, client, "fd00:96::10", 80, "tcp", count=30, timeout=1)
    assert v6.backends == {"b1", "b2"} and v6.failed == 0, v6
    sticky = probe(topology, client, "10.96.0.14", 80, "tcp", count=15, timeout=1)
    assert len(sticky.backends) == 1 and sticky.answered == 15, sticky
    hairpin = probe(topology, b1, "10.96.0.10", 80, "tcp", count=30, timeout=1)
    assert "b1" in hairpin.backends and hairpin.failed == 0, hairpin
    assert b1.ipv4 not in hairpin.sources["b1"], "hairpin traffic must be masqueraded"
    late = probe(topology, client, "10.96.0.16", 80, "tcp", count=5, timeout=1)
    assert late.backends == {"b2"} and late.failed == 0, late  # added by the partial sync
    allowed = probe(topology, client, "192.0.2.30", 80, "tcp", count=5, timeout=1)
    assert allowed.answered == 5, allowed
    denied = probe(topology, n2, "192.0.2.30", 80, "tcp", count=2, timeout=1)
    assert denied.answered == 0 and denied.timeout == 2, denied

    # A restarted agent: its first sync is a full one; it removes KPX- chains it does not
    # want and keeps exactly one jump rule per built-in chain.
    tool(topology, n1, ["iptables", "-t", "nat", "-N", "KPX-SVC-STALE"])
    run("sync")
    for fam in (4, 6):
        text = saved(topology, n1, fam)
        for chain, rule in JUMPS.items():
            assert len(re.findall(rf"^-A {chain} {re.escape(rule)}$", text, re.M)) == 1, text
        assert text.count("-A OUTPUT -m conntrack --ctstate NEW -m comment --comment kpx") == 1
        assert "KPX-SVC-STALE" not in text
        assert text.count(":FOREIGN - [0:0]") == 2 and "-A PREROUTING -j FOREIGN" in text
    again = probe(topology, client, "10.96.0.10", 80, "tcp", count=20, timeout=1)
    assert again.backends == {"b1", "b2"} and again.failed == 0, again

    run("cleanup")
    for fam in (4, 6):
        text = saved(topology, n1, fam)
        assert "KPX" not in text and "--comment kpx" not in text, text
        assert "-A PREROUTING -j FOREIGN" in text and "-A INPUT -j FOREIGN" in text, text
        assert text.count("-A FOREIGN -j RETURN") == 2, text
    run("cleanup")  # nothing left: a second cleanup is a no-op


# Runs inside a node's netns: argv = list first ("on"/"off"), ports. Two full syncs (a start
# into a table with someone else's chain, then a restarted agent's into its own rules).
MANY = """
import sys
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.iptables import script
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.kernel import NodeKernel

listing, count = sys.argv[1], int(sys.argv[2])
if listing == "off":
    script.LIST_FIRST_MIN_CHAINS = 10**9
else:  # list at the restart too, into the table full of its own rules (at scale it pays)
    script.SCAN_STEPS_PER_LISTED_RULE = 0
ip = IP.of
ports = [
    ServicePort(
        ServicePortKey("d", f"s{i}", "", Protocol.TCP, 4), 80,
        cluster_ips=(ip(f"10.96.{i // 250}.{i % 250 + 1}"),),
        cluster_endpoints=(Endpoint(ip(f"10.244.{i // 250}.{i % 250 + 1}"), 8080),
                           Endpoint(ip(f"10.245.{i // 250}.{i % 250 + 1}"), 8080)),
        node_port=30000 + i if i % 3 == 0 else 0,
    )
    for i in range(count)
]
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/15"),))
state = local_state(NodeInfo("n1", (ip("192.0.2.1"),)), settings, ports)
for start in ("start", "restart"):
    tools = NodeKernel()
    scripts = []

    def recorded(family, pieces, restore_pieces=tools.restore_pieces):
        pieces = list(pieces)  # (a full sync's script is read whole here: it is recorded)
        scripts.append((family, "".join(pieces)))
        restore_pieces(family, pieces)

    tools.restore_pieces = recorded
    backend = IptablesBackend(settings, tools)
    backend.sync(state, None)
    nat = next(s for f, s in scripts if f == 4 and s.startswith("*nat"))
    print(start, script.LIST_FIRST in nat.splitlines())
"""


def test_a_full_sync_that_lists_first_programs_exactly_the_same_rules(
    topology: Topology,
) -> None:
    """iptables-nft's restore of many chains is cheaper after a line that names no chain
    (script.LIST_FIRST, `-S`): the rules it leaves must be exactly those of the same sync
    without it, at a start and at a restart, with someone else's chain left alone."""
    dumps = {}
    for listing in ("on", "off"):
        node = topology.add_node(f"n{listing}")
        tool(topology, node, ["iptables", "-t", "nat", "-N", "FOREIGN"])
        tool(topology, node, ["iptables", "-t", "nat", "-A", "PREROUTING", "-j", "FOREIGN"])
        out = tool(topology, node, [sys.executable, "-c", MANY, listing, "300"])
        on = str(listing == "on")
        assert out.split() == ["start", on, "restart", on], out
        dumps[listing] = [
            line
            for line in saved(topology, node, 4).splitlines()
            if (not line.startswith("#") and not line.startswith(":")) or "KPX" in line
        ]
    assert dumps["on"] == dumps["off"]
    nat = dumps["on"]
    assert sum(line.startswith("-A KPX-SVC-") for line in nat) == 300 * 3, nat[:20]
    assert "-A PREROUTING -j FOREIGN" in nat


# Runs inside a node's netns: 20 Services, each with one local endpoint (a KPX-HAIRPIN rule
# each); one moves (a partial sync edits the chain rule by rule); then a hairpin rule is
# deleted behind the agent's back and its Service moves too: the `-D` of the missing rule is
# refused, and the full sync that follows rewrites everything.
HAIRPIN = """
import subprocess
from ipaddress import ip_network as net
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.base import BackendError
from kpx_agent.backends.iptables.backend import IptablesBackend
from kpx_agent.backends.iptables.kernel import NodeKernel

ip = IP.of
def port(i, address):
    return ServicePort(
        ServicePortKey("d", f"s{i}", "", Protocol.TCP, 4), 80,
        cluster_ips=(ip(f"10.96.0.{i + 1}"),),
        cluster_endpoints=(Endpoint(address, 8080, True),),
    )
ports = {i: port(i, f"10.244.1.{i + 1}") for i in range(20)}
settings = DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),))
def state():
    return local_state(NodeInfo("n1", (ip("192.0.2.1"),)), settings, list(ports.values()))
tools = NodeKernel()
scripts = []
restore = tools.restore
tools.restore = lambda family, text: (scripts.append(text), restore(family, text))
backend = IptablesBackend(settings, tools)
backend.sync(state(), None)
ports[0] = port(0, "10.244.1.200")
done = len(scripts)
backend.sync(state(), [ports[0].key])
lines = [line for text in scripts[done:] for line in text.splitlines()]
print("edits", *sorted(line.split()[0] for line in lines if "KPX-HAIRPIN" in line))
subprocess.run(
    ["iptables", "-t", "nat", "-D", "KPX-HAIRPIN",
     "-s", "10.244.1.2/32", "-d", "10.244.1.2/32", "-j", "KPX-MARK-MASQ"],
    check=True,
)
ports[1] = port(1, "10.244.1.201")
try:
    backend.sync(state(), [ports[1].key])
    print("accepted")
except BackendError:
    print("refused")
backend.sync(state(), None)
"""


def test_a_partial_sync_edits_the_hairpin_chain_rule_by_rule_and_a_missing_rule_forces_a_full(
    topology: Topology,
) -> None:
    """script.ORDER_FREE: a local endpoint's change deletes and appends its KPX-HAIRPIN rules
    (`-D`, `-A`) instead of rewriting the chain; the kernel then holds exactly the wanted
    rules. A rule deleted behind the agent's back makes that `-D` fail: the restore is refused
    as a whole, and the next (full) sync leaves the chain right again."""
    node = topology.add_node("n1")
    out = tool(topology, node, [sys.executable, "-c", HAIRPIN])
    assert out.split() == ["edits", "-A", "-D", "refused"], out
    hairpin = sorted(
        line for line in saved(topology, node, 4).splitlines() if line.startswith("-A KPX-HAIRPIN ")
    )
    want = ["10.244.1.200", "10.244.1.201", *(f"10.244.1.{i + 1}" for i in range(2, 20))]
    assert hairpin == sorted(
        f"-A KPX-HAIRPIN -s {a}/32 -d {a}/32 -j KPX-MARK-MASQ" for a in want
    ), hairpin


# Runs inside a node's netns: kernel.restore_pieces, the full sync's streamed restore, when
# making a piece fails half-way and when the tool refuses a line while more is still to come.
PIECES = """
import os
import subprocess
import sys
import time
from kpx_agent.backends.base import BackendError
from kpx_agent.backends.iptables.kernel import restore_pieces

FEEDER = '''
import time
from kpx_agent.backends.iptables.kernel import restore_pieces
def slow():
    yield "*nat\\\\n:KPX-TEST - [0:0]\\\\n"
    for i in range(3000):  # more than one write (64 KiB) reaches the tool
        yield f"-A KPX-TEST -d 10.96.{i // 250}.{i % 250 + 1}/32 -j RETURN\\\\n"
    print("fed", flush=True)
    time.sleep(60)  # killed here
    yield "COMMIT\\\\n"
restore_pieces(4, slow())
'''

made = [0]

def ours():
    save = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True)
    return sum("KPX-TEST" in line for line in save.stdout.splitlines())

def pieces(bad_line=None, fail_at=None):
    yield "*nat\\n:KPX-TEST - [0:0]\\n"
    if bad_line:
        yield bad_line + "\\n"
    for i in range(20000):  # about 1.3 MB: the tool reads the start long before the end
        if i == fail_at:
            raise RuntimeError("a bug while rendering")
        made[0] += 1
        yield f"-A KPX-TEST -d 10.96.{i // 250}.{i % 250 + 1}/32 -j RETURN\\n"
    yield "COMMIT\\n"

try:
    restore_pieces(4, pieces(fail_at=15000))
except RuntimeError as exc:
    print("raised", exc.args[0].split()[-1], ours())
made[0] = 0
try:
    restore_pieces(4, pieces(bad_line="-A KPX-TEST --no-such-option"))
except BackendError as exc:
    print("refused", "--no-such-option" in str(exc), made[0] < 20000, ours())
made[0] = 0
# The agent killed while it feeds the tool: the tool reads the end of its input, no COMMIT.
feeder = subprocess.Popen([sys.executable, "-c", FEEDER], stdout=subprocess.PIPE, text=True)
assert feeder.stdout.readline() == "fed\\n"
task = f"/proc/{feeder.pid}/task/{feeder.pid}/children"
with open(task) as children:
    (tool,) = children.read().split()
feeder.kill()
feeder.wait()
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{tool}") and open(f"/proc/{tool}/stat").read().split()[2] != "Z":
    assert time.monotonic() < deadline, "the tool did not end"
    time.sleep(0.1)
print("killed", ours())
restore_pieces(4, pieces())
print("loaded", made[0])
"""


def test_a_streamed_restore_commits_only_a_whole_script(topology: Topology) -> None:
    """The full sync's restore is fed while it is made (`kernel.restore_pieces`): a piece
    that fails to be made kills the tool before it reads a COMMIT, so the table is left as
    it was; a line the tool refuses stops the feeding, with the tool's error; an agent
    killed while it feeds leaves the tool an input without a COMMIT, which it does not
    commit; a whole script loads."""
    node = topology.add_node("n1")
    out = tool(topology, node, [sys.executable, "-c", PIECES])
    lines = out.splitlines()
    assert lines[0] == "raised rendering 0", out
    assert lines[1] == "refused True True 0", out
    assert lines[2] == "killed 0", out
    assert lines[3] == "loaded 20000", out
    rules = [line for line in saved(topology, node, 4).splitlines() if "KPX-TEST" in line]
    assert len(rules) == 1 + 20000, rules[:3]  # the last, whole script only
