"""The rendered nftables transactions load into a real kernel (in a fresh netns) and mean what
the renderer says: real packets follow the maps, deltas apply, and swaps are idempotent. Session
affinity across restarts and endpoint changes is checked here for both nftables and iptables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kpx_cluster.netns import Node, Pod, Topology
from kpx_cluster.probe import probe

pytestmark = pytest.mark.netns
GOLDEN = Path(__file__).resolve().parents[1] / "unit" / "golden"


def nft(topo: Topology, node: str, *args: str, script: str | None = None) -> str:
    argv = ["nft", *args] if script is None else ["nft", "-f", "-"]
    result = topo.exec(topo.nodes[node], argv, input=script, check=True)
    return result.stdout


def test_golden_transactions_load_and_swap(topology: Topology) -> None:
    topology.add_node("n1")
    nft(topology, "n1", script=(GOLDEN / "full_sync.nft").read_text())
    nft(topology, "n1", script=(GOLDEN / "partial_sync.nft").read_text())
    listed = nft(topology, "n1", "list", "map", "ip", "kpx", "service-ips")
    assert "10.96.0.10 . tcp . 80 : goto endpoints-1" in listed
    # A full sync again (what a restarted agent does) replaces the table in one transaction.
    nft(topology, "n1", script=(GOLDEN / "full_sync.nft").read_text())
    listed = nft(topology, "n1", "list", "map", "ip", "kpx", "service-ips")
    assert "10.96.0.10 . tcp . 80 : goto endpoints-2" in listed
    assert nft(topology, "n1", "list", "tables").split() == [
        "table",
        "ip",
        "kpx",
        "table",
        "ip6",
        "kpx",
    ]


def two_nodes_with_backends(topology: Topology) -> tuple[Node, Pod, Pod, Pod]:
    """Nodes n1 and n2, an echo backend on each (b1, b2, port 8080), a client pod on n1."""
    n1, n2 = topology.add_node("n1"), topology.add_node("n2")
    b1, b2 = topology.add_pod(n1, "b1"), topology.add_pod(n2, "b2")
    client = topology.add_pod(n1, "client")
    for pod in (b1, b2):
        topology.run_ready(
            pod,
            topology.python_argv("kpx_cluster.echo_server", "--name", pod.name, "--port", "8080"),
        )
    return n1, b1, b2, client


def test_backend_programs_real_traffic(topology: Topology) -> None:
    """The backend, driven in-process inside a node netns, sends a pod's packets to both
    backends, rejects a port without endpoints, and serves UDP through the same maps."""
    n1, b1, b2, client = two_nodes_with_backends(topology)
    program = f"""
import sys
from ipaddress import ip_network
from kpx_agent.model.types import IP
ip = IP.of
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.nftables.backend import NftablesBackend
eps = (Endpoint(ip("{b1.ipv4}"), 8080, True), Endpoint(ip("{b2.ipv4}"), 8080))
ports = [
    ServicePort(ServicePortKey("d", "web", "", Protocol.TCP, 4), 80,
                cluster_ips=(ip("10.96.0.10"),), cluster_endpoints=eps, external_endpoints=eps),
    ServicePort(ServicePortKey("d", "dns", "", Protocol.UDP, 4), 53,
                cluster_ips=(ip("10.96.0.10"),), cluster_endpoints=eps, external_endpoints=eps),
    ServicePort(ServicePortKey("d", "none", "", Protocol.TCP, 4), 81,
                cluster_ips=(ip("10.96.0.10"),)),
]
b = NftablesBackend(DataplaneSettings(cluster_cidrs=(ip_network("10.244.0.0/16"),)))
b.sync(local_state(NodeInfo("n1", (ip("{n1.ipv4}"),)), b.settings, ports), None)
"""
    topology.exec(n1, [sys.executable, "-c", program], check=True)
    tcp = probe(topology, client, "10.96.0.10", 80, "tcp", count=30, timeout=1)
    assert tcp.backends == {"b1", "b2"} and tcp.failed == 0, tcp
    udp_target = f"echo port 53 -> 8080 over UDP"  # noqa: F541 - label for the assertion
    dns = probe(topology, client, "10.96.0.10", 53, "udp", count=20, timeout=1)
    assert dns.backends == {"b1", "b2"}, (udp_target, dns)
    refused = probe(topology, client, "10.96.0.10", 81, "tcp", count=3, timeout=2)
    assert refused.refused == 3 and refused.timeout == 0, refused


def test_affinity_and_load_balancer_source_ranges(topology: Topology) -> None:
    n1, b1, b2, client = two_nodes_with_backends(topology)
    program = f"""
import dataclasses
from ipaddress import ip_network as net
from kpx_agent.model.types import IP
ip = IP.of
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.backends.nftables.backend import NftablesBackend
eps = (Endpoint(ip("{b1.ipv4}"), 8080, True), Endpoint(ip("{b2.ipv4}"), 8080))
def port(name, vip, **kw):
    return ServicePort(ServicePortKey("d", name, "", Protocol.TCP, 4), 80, cluster_ips=(ip(vip),),
                       cluster_endpoints=eps, external_endpoints=eps, **kw)
ports = [
    port("sticky", "10.96.0.20", affinity_timeout=300),
    port("lb-open", "10.96.0.21", load_balancer_ips=(ip("192.0.2.21"),),
         load_balancer_source_ranges=(net("{client.ipv4}/32"),)),
    port("lb-closed", "10.96.0.22", load_balancer_ips=(ip("192.0.2.22"),),
         load_balancer_source_ranges=(net("198.51.100.0/24"),)),
]
b = NftablesBackend(DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),)))
state = local_state(NodeInfo("n1", (ip("{n1.ipv4}"),)), b.settings, ports)
b.sync(state, None)
"""
    topology.exec(n1, [sys.executable, "-c", program], check=True)
    sticky = probe(topology, client, "10.96.0.20", 80, "tcp", count=20, timeout=1)
    assert sticky.failed == 0 and len(sticky.backends) == 1, sticky
    open_lb = probe(topology, client, "192.0.2.21", 80, "tcp", count=10, timeout=1)
    assert open_lb.failed == 0 and open_lb.backends, open_lb
    closed_lb = probe(topology, client, "192.0.2.22", 80, "tcp", count=2, timeout=1)
    assert closed_lb.timeout == 2 and not closed_lb.backends, closed_lb
    # The same backends through the cluster IP of the firewalled service: not filtered.
    inside = probe(topology, client, "10.96.0.22", 80, "tcp", count=4, timeout=1)
    assert inside.failed == 0, inside


STICKY = """
import json, sys
from ipaddress import ip_network as net
from kpx_agent.model.types import IP
ip = IP.of
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
if sys.argv[2] == "nftables":
    from kpx_agent.backends.nftables import names as n
    from kpx_agent.backends.nftables.backend import NftablesBackend as Backend
    def remembered(sp, ep):  # the set of the endpoint's clients
        return n.affinity_set(sp.key, 300, ep.ip, ep.port)
else:
    from kpx_agent.backends.iptables import names as n
    from kpx_agent.backends.iptables.backend import IptablesBackend as Backend
    def remembered(sp, ep):  # the `recent` list of the endpoint's clients
        return n.affinity_list(sp.key, ep)
def state(backends):
    eps = tuple(Endpoint(ip(a), 8080, a.startswith("{local_prefix}")) for a in backends)
    sp = ServicePort(ServicePortKey("d", "sticky", "", Protocol.TCP, 4), 80,
                     cluster_ips=(ip("10.96.0.20"),), cluster_endpoints=eps,
                     external_endpoints=eps, affinity_timeout=300)
    return sp, local_state(NodeInfo("n1", (ip("{node_ip}"),)), b.settings, [sp])
b = Backend(DataplaneSettings(cluster_cidrs=(net("10.244.0.0/16"),)))
steps = json.loads(sys.argv[1])
sp, first = state(steps[0])
b.sync(first, None)  # a new backend: a full sync (in place over a table in the kernel)
for backends in steps[1:]:
    sp, later = state(backends)
    b.sync(later, [sp.key])  # a partial sync
print(json.dumps({{str(ep.ip): remembered(sp, ep) for ep in sp.cluster_endpoints}}))
"""


@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_session_affinity_survives_a_restart_and_other_endpoints_changing(
    topology: Topology, mode: str
) -> None:
    """A client stays with its endpoint when the agent restarts (a full sync over the rules
    in the kernel) and when other endpoints come and go (partial syncs), as with upstream's
    per-endpoint affinity sets and `recent` lists: the set (nftables) or `recent` list
    (iptables) of its endpoint keeps the client's address."""
    n1, b1, b2, client = two_nodes_with_backends(topology)
    b3 = topology.add_pod(topology.nodes["n2"], "b3")
    topology.run_ready(
        b3, topology.python_argv("kpx_cluster.echo_server", "--name", "b3", "--port", "8080")
    )
    pods = {pod.ipv4: pod.name for pod in (b1, b2, b3)}
    program = STICKY.format(local_prefix=b1.ipv4, node_ip=n1.ipv4)

    def sync(*steps: list[str]) -> dict[str, str]:
        argv = [sys.executable, "-c", program, json.dumps(list(steps)), mode]
        done = topology.exec(n1, argv, check=True)
        return dict(json.loads(done.stdout.splitlines()[-1]))

    def holds_client(name: str) -> bool:
        if mode == "nftables":
            return client.ipv4 in nft(topology, "n1", "list", "set", "ip", "kpx", name)
        listed = topology.exec(n1, ["cat", f"/proc/net/xt_recent/{name}"], check=True)
        return f"src={client.ipv4} " in listed.stdout

    sets = sync([b1.ipv4, b2.ipv4])
    first = probe(topology, client, "10.96.0.20", 80, "tcp", count=10, timeout=1)
    assert first.failed == 0 and len(first.backends) == 1, first
    (chosen,) = first.backends
    chosen_ip = next(a for a, name in pods.items() if name == chosen)
    assert holds_client(sets[chosen_ip])
    # A restart: the client's entry is still there before any packet, and it is obeyed.
    sets = sync([b1.ipv4, b2.ipv4])
    assert holds_client(sets[chosen_ip])
    again = probe(topology, client, "10.96.0.20", 80, "tcp", count=10, timeout=1)
    assert again.failed == 0 and again.backends == {chosen}, again
    # Another endpoint added, then the one not chosen removed (partial syncs).
    other = next(a for a in (b1.ipv4, b2.ipv4) if a != chosen_ip)
    sets = sync([b1.ipv4, b2.ipv4], [b1.ipv4, b2.ipv4, b3.ipv4], [chosen_ip, b3.ipv4])
    assert holds_client(sets[chosen_ip]) and other not in sets
    later = probe(topology, client, "10.96.0.20", 80, "tcp", count=10, timeout=1)
    assert later.failed == 0 and later.backends == {chosen}, later


def test_streamed_transaction_is_all_or_nothing(topology: Topology) -> None:
    """The runner streams a transaction into nft: a producer that fails half way, and a
    transaction nft rejects at its very end, both leave the kernel as it was."""
    n1 = topology.add_node("n1")
    program = """
from kpx_agent.backends.base import BackendError
from kpx_agent.backends.nftables.kernel import run_script
run_script(["table ip kpx {\\n", "  set keep { type ipv4_addr; elements = { 10.0.0.1 } }\\n}\\n"])
def broken():
    yield "add set ip kpx partial { type ipv4_addr; }\\n"
    yield "add element ip kpx keep { 10.0.0.2 }\\n" * 20000  # more than a pipe buffer
    raise ValueError("renderer bug")
try:
    run_script(broken())
except ValueError:
    pass
else:
    raise SystemExit("the producer's error was swallowed")
try:
    run_script(["add element ip kpx keep { 10.0.0.3 }\\n", "add element ip kpx nope { 1 }\\n"])
except BackendError as exc:
    assert "nope" in str(exc), exc
else:
    raise SystemExit("a rejected transaction did not raise")
"""
    topology.exec(n1, [sys.executable, "-c", program], check=True)
    listed = nft(topology, "n1", "list", "table", "ip", "kpx")
    assert "10.0.0.1" in listed and "10.0.0.2" not in listed and "10.0.0.3" not in listed, listed
    assert "partial" not in listed, listed


def test_a_partial_sync_adds_a_new_endpoint_count(topology: Topology) -> None:
    """A Service first with one endpoint, then with two: the second sync is partial and
    creates the `endpoints-2` map and chain next to the ones in the kernel; traffic then
    reaches both backends (TCP and UDP through the same new map)."""
    n1, b1, b2, client = two_nodes_with_backends(topology)
    program = f"""
from kpx_agent.model.types import *
from kpx_agent.model.service_ports import local_state
from kpx_agent.model.types import IP
from kpx_agent.backends.nftables.backend import NftablesBackend
ip = IP.of
b = NftablesBackend(DataplaneSettings())
state = local_state(NodeInfo("n1", (ip("{n1.ipv4}"),)), b.settings)
def web(proto, port, eps):
    key = ServicePortKey("d", "web-" + proto.value, "", proto, 4)
    state.services[key] = ServicePort(key, port, cluster_ips=(ip("10.96.0.30"),),
                                      cluster_endpoints=eps, external_endpoints=eps)
    return key
one = (Endpoint(ip("{b1.ipv4}"), 8080),)
two = one + (Endpoint(ip("{b2.ipv4}"), 8080),)
web(Protocol.TCP, 80, one), web(Protocol.UDP, 53, one)
b.sync(state, None)
assert "endpoints-2" not in b.last_script
changed = [web(Protocol.TCP, 80, two), web(Protocol.UDP, 53, two)]
b.sync(state, changed)
assert "add map ip kpx endpoints-2" in b.last_script, b.last_script
assert "delete table" not in b.last_script, b.last_script
"""
    topology.exec(n1, [sys.executable, "-c", program], check=True)
    tcp = probe(topology, client, "10.96.0.30", 80, "tcp", count=30, timeout=1)
    assert tcp.backends == {"b1", "b2"} and tcp.failed == 0, tcp
    udp = probe(topology, client, "10.96.0.30", 53, "udp", count=20, timeout=1)
    assert udp.backends == {"b1", "b2"}, udp


def test_present_families_asks_without_loading_or_changing_anything(topology: Topology) -> None:
    """The periodic "are our rules still there" check: no family without our tables, both
    with them, one once the other is gone; its check-mode flush leaves the rules as they were."""
    n1 = topology.add_node("n1")
    check = [
        sys.executable,
        "-c",
        "from kpx_agent.backends.nftables.kernel import present_families as p; print(sorted(p()))",
    ]
    assert topology.exec(n1, check, check=True).stdout.strip() == "[]"
    nft(topology, "n1", script=(GOLDEN / "full_sync.nft").read_text())
    before = nft(topology, "n1", "list", "ruleset")
    assert topology.exec(n1, check, check=True).stdout.strip() == "[4, 6]"
    assert nft(topology, "n1", "list", "ruleset") == before
    nft(topology, "n1", "delete", "table", "ip6", "kpx")
    assert topology.exec(n1, check, check=True).stdout.strip() == "[4]"


TABLES_PROBE = """
import os
os.environ["PATH"] = "/nonexistent"  # no nft to run: the questions go over netlink
from kpx_agent.backends.kernel.nft_query import tables_named
from kpx_agent.backends.nftables.kernel import our_tables
kube_proxy = ["ip kube-proxy", "ip6 kube-proxy", "inet filter"]
print(sorted(our_tables()), sorted(tables_named(kube_proxy)))
"""


def test_which_tables_exist_is_asked_over_netlink(topology: Topology) -> None:
    """The nftables mode's cleanup (`our_tables`, run by every other mode after its first
    sync) and the kube-proxy takeover ask which tables exist with one netlink question per
    table, with no `nft` on PATH and an iptables-nft nat table beside them: none, then each
    that is there; a table of our name in another family is not ours."""
    n1 = topology.add_node("n1")
    probe = [sys.executable, "-c", TABLES_PROBE]
    topology.exec(n1, ["iptables", "-t", "nat", "-N", "SITE-CHAIN"], check=True)
    assert topology.exec(n1, probe, check=True).stdout.strip() == "[] []"
    nft(topology, "n1", script=(GOLDEN / "full_sync.nft").read_text())
    nft(topology, "n1", script="add table ip kube-proxy\nadd table inet kpx\n")
    listed = topology.exec(n1, probe, check=True).stdout.strip()
    assert listed == "['ip kpx', 'ip6 kpx'] ['ip kube-proxy']", listed
    nft(topology, "n1", "delete", "table", "ip6", "kpx")
    listed = topology.exec(n1, probe, check=True).stdout.strip()
    assert listed == "['ip kpx'] ['ip kube-proxy']", listed


DIGEST_PROBE = """
from kpx_agent.backends.kernel.nft_query import Overtaken
from kpx_agent.backends.nftables.kernel import table_digest
assert table_digest(4) == table_digest(4, lambda: True) != table_digest(6)
asked = []
def still():
    asked.append(1)
    return len(asked) < 3
try:
    table_digest(4, still)
    print("read whole")
except Overtaken:
    print("stopped after", len(asked))
"""


def test_a_digest_read_stops_as_soon_as_the_generation_moved(topology: Topology) -> None:
    """The drift check's read of our table asks `still` before each read of the kernel's
    answers and stops at the first false, without reading the rest."""
    n1 = topology.add_node("n1")
    nft(topology, "n1", script=(GOLDEN / "full_sync.nft").read_text())
    done = topology.exec(n1, [sys.executable, "-c", DIGEST_PROBE], check=True)
    assert done.stdout.strip() == "stopped after 3"


def normalized_ruleset(topo: Topology, node: str) -> list[object]:
    """`nft -j list ruleset` without handles, with each set's elements sorted (a hash set
    lists in an order seeded per table)."""
    import json

    out = []
    for item in json.loads(nft(topo, node, "-j", "list", "ruleset"))["nftables"]:
        for body in item.values():
            if isinstance(body, dict):
                body.pop("handle", None)
                if "elem" in body:
                    body["elem"] = sorted(body["elem"], key=json.dumps)
        out.append(item)
    return out


def test_cold_start_by_netlink_equals_the_nft_transaction(topology: Topology) -> None:
    """The cold start's netlink load leaves the kernel exactly as the all-nft transaction
    does (every set type, both families, verdicts, numgen buckets), read back by nft."""
    n1, _ = topology.add_node("n1"), topology.add_node("n2")
    unit = Path(__file__).resolve().parents[1] / "unit"
    program = f"""
import sys
sys.path.insert(0, {str(unit)!r})
from backend_samples import SETTINGS, sample_state
from kpx_agent.backends.nftables.backend import NftablesBackend
b = NftablesBackend(SETTINGS)
b.sync(sample_state(), None)
assert sorted(b.last_loaded) == [4, 6], b.last_loaded  # no table was there: netlink
assert "add element ip kpx service-ips" not in b.last_script
"""
    topology.exec(n1, [sys.executable, "-c", program], check=True)
    nft(topology, "n2", script=(GOLDEN / "full_sync.nft").read_text())
    assert normalized_ruleset(topology, "n1") == normalized_ruleset(topology, "n2")
    listed = nft(topology, "n1", "list", "map", "ip", "kpx", "endpoints-2")
    assert "10.96.0.10 . tcp . 80 . 1 : 10.244.2.2 . 8080" in listed
    listed = nft(topology, "n1", "list", "map", "ip", "kpx", "short-circuit-nodeports")
    assert "tcp . 30081 : goto short-circuit-nodeport-endpoints-2" in listed


def test_a_refused_element_batch_applies_nothing(topology: Topology) -> None:
    """One batch is one transaction: a message the kernel refuses (a set that is not there)
    leaves every other set of the batch untouched, and the error names the set."""
    n1 = topology.add_node("n1")
    vpp = "ipv4_addr . inet_proto . inet_service"
    nft(topology, "n1", script=f"table ip kpx {{\n set cluster-ips {{ type {vpp}; }}\n}}\n")
    program = """
from kpx_agent.backends.base import BackendError
from kpx_agent.backends.nftables.kernel import load_elements
from kpx_agent.model.types import IP, Protocol
try:
    load_elements({4: {"cluster-ips": [((IP.of("10.96.0.1"), Protocol.TCP, 80), None)],
                       "hairpin": [((IP.of("10.244.0.1"), IP.of("10.244.0.1")), None)]}})
except BackendError as err:
    print("refused:", err)
"""
    out = topology.exec(n1, [sys.executable, "-c", program], check=True).stdout
    assert "refused:" in out and "ip kpx hairpin" in out, out
    assert "10.96.0.1" not in nft(topology, "n1", "list", "set", "ip", "kpx", "cluster-ips")
    ok = program.replace('"hairpin": [((IP.of("10.244.0.1"), IP.of("10.244.0.1")), None)]', "")
    assert topology.exec(n1, [sys.executable, "-c", ok], check=True).stdout == ""
    assert "10.96.0.1 . tcp . 80" in nft(topology, "n1", "list", "set", "ip", "kpx", "cluster-ips")


def test_a_refused_batch_stops_the_load_and_keeps_the_batches_before_it(
    topology: Topology,
) -> None:
    """A large load goes in several batches: when the kernel refuses one, the error names the
    set, the batches before it stay (they filled a table a full sync had just created; the
    next full sync replaces it whole) and nothing after it is sent."""
    n1 = topology.add_node("n1")
    vpp = "ipv4_addr . inet_proto . inet_service"
    nft(topology, "n1", script=f"table ip kpx {{\n set cluster-ips {{ type {vpp}; }}\n}}\n")
    program = """
from kpx_agent.backends.base import BackendError
from kpx_agent.backends.nftables import netlink_batch
from kpx_agent.backends.nftables.kernel import load_elements
from kpx_agent.model.types import IP, Protocol
ips = [((IP.of(f"10.96.{i // 256}.{i % 256}"), Protocol.TCP, 80), None) for i in range(7000)]
assert netlink_batch.BATCH_ELEMENTS == 5000
hairpin = [((IP.of("10.244.0.1"), IP.of("10.244.0.1")), None)]
try:
    load_elements({4: {"cluster-ips": ips, "hairpin": hairpin}})
except BackendError as err:
    print("refused:", err)
"""
    out = topology.exec(n1, [sys.executable, "-c", program], check=True).stdout
    assert "refused:" in out and "ip kpx hairpin" in out, out
    listed = nft(topology, "n1", "list", "set", "ip", "kpx", "cluster-ips")
    assert listed.count(" . tcp . 80") == 5000, "the first batch only"
