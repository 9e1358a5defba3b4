"""The migration tests' node recorder (kpx_cluster.node_events) on a node of a test topology:
it hears a ruleset change and a refused connection's conntrack event, and `explain` turns them
into the lines a failed migration prints (the reply tuple says the node sent the connection to
itself: no DNAT)."""

from __future__ import annotations

import time

import pytest

from kpx_cluster import node_events
from kpx_cluster.netns import Topology
from kpx_cluster.probe import probe

pytestmark = pytest.mark.netns

# conntrack follows a netns's traffic only once a rule there needs it
CT_RULES = """
table inet kpxtest_ct {
    chain prerouting {
        type filter hook prerouting priority 0; policy accept;
        ct state new counter
    }
}
"""


def test_recording_hears_a_rule_change_and_a_refused_connection(topology: Topology) -> None:
    n1 = topology.add_node("n1")
    a = topology.add_pod(n1, "a")
    with node_events.recording(topology, [n1]) as events:
        topology.exec(n1, ["nft", "-f", "-"], input=CT_RULES, check=True)
        at = time.time()
        result = probe(topology, a, n1.ipv4, 9, "tcp", count=1, timeout=2)
        assert result.refused == 1, result
        deadline = time.monotonic() + 5
        while not any(line.source == "conntrack" for line in events.snapshot()):
            assert time.monotonic() < deadline, events.snapshot()
            time.sleep(0.05)
    out = node_events.explain(events.snapshot(), [(at, f"{n1.ipv4}:9", "refused")])
    assert any(" n1 nft: " in line and "kpxtest_ct" in line for line in out), out
    conns = [line for line in out if " n1 conntrack: " in line]
    assert conns, out  # (the kernel may report one connection's NEW more than once)
    for conn in conns:
        original, reply = conn.split("[UNREPLIED]")
        assert f"src={a.ipv4} dst={n1.ipv4}" in original and "dport=9 " in original, conns
        assert f"src={n1.ipv4} dst={a.ipv4} sport=9 " in reply, conns  # answered by n1 itself
