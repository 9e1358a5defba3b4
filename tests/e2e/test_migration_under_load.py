"""Issue #18, proof under load: spec.mode iptables -> nftables on three simulated nodes while a
client on every node keeps opening connections, exchanging UDP and holding connections open.

kpx is installed from its manifests (the operator and the agents run from the built images
under runc) in mode iptables; backends on every node serve two ClusterIP Services and a
NodePort (`kpx_cluster.migration`). A load client in a pod netns on every node opens a new TCP
connection every 15 ms (round-robin over the three ClusterIPs and the NodePort on each node's
address), exchanges a UDP datagram every 20 ms the same way, and holds two connections open.
Then spec.mode is patched to nftables: the agents' DaemonSet rolls one node at a time; each new
agent programs nftables, verifies it, then removes the iptables rules. Not one new connection
may fail, not one UDP exchange be lost, every held connection must survive, and afterwards no
node may have a KPX- chain or a jump into one, in any iptables variant. `make bench-migration`
runs both directions and prints the table (bench/migration.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from kpx_cluster.controlplane import Cluster
from kpx_cluster.migration import (
    LoadOptions,
    MigrationEnv,
    migration_cluster,
    mode_rules,
    preflight_load,
    switch,
    table_row,
)

pytestmark = [pytest.mark.e2e, pytest.mark.netns]


@pytest.fixture(scope="module")
def env(cluster: Cluster) -> Iterator[MigrationEnv]:
    try:
        with migration_cluster(cluster, "iptables") as env:
            yield env
    except RuntimeError as err:  # the images are missing or stale
        if "make image" in str(err):
            pytest.fail(str(err), pytrace=False)
        raise


def test_iptables_to_nftables_under_load_fails_nothing_and_leaves_nothing(
    env: MigrationEnv,
) -> None:
    # The load itself works before the switch: every target answers, from every node.
    for summary in preflight_load(env):
        assert summary.tcp.failed == 0 and summary.udp.failed == 0, summary
        assert summary.held_survived == len(summary.held) == 1, summary.held
        assert len(summary.tcp.backends) == len(env.nodes), summary.tcp.backends
    for node in env.nodes:
        assert mode_rules(env.topo, node, "iptables"), f"{node.name}: no iptables rules"

    result = switch(env, "iptables", "nftables", LoadOptions())
    print(table_row(result))

    assert result.failures() == [], "\n".join(result.failures())
    # Enough load to tell: the whole rollout was covered at the fixed rate.
    assert result.load_seconds > result.duration
    assert result.total("tcp", "tried") > 0.8 * result.load_seconds / 0.015 * len(env.nodes)
    assert result.total("udp", "tried") > 0.8 * result.load_seconds / 0.02 * len(env.nodes)
    assert result.held == 2 * len(env.nodes)
    # Node by node (maxUnavailable 1): the new agents became Ready one after another.
    times = sorted(result.node_ready.values())
    assert len(times) == len(env.nodes)
    assert all(b - a > 0.5 for a, b in itertools.pairwise(times)), result.node_ready
    # The new mode serves on every node, the old one left nothing.
    for node in env.nodes:
        assert mode_rules(env.topo, node, "nftables"), f"{node.name}: no kpx nftables table"
        assert mode_rules(env.topo, node, "iptables") == []
