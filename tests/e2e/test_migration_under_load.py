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
    switch_with_refusal,
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


def test_a_node_whose_new_agent_cannot_program_stops_the_rollout_and_keeps_serving(
    env: MigrationEnv,
) -> None:
    """nftables refused on one node (another socket owns the table `ip kpx`): its new agent
    never has a verified sync, so it is not Ready (/readyz), the DaemonSet's rolling update does
    not move past it, and that node keeps serving on its iptables rules; once the refusal is
    lifted the rollout completes. No traffic fails meanwhile."""
    if not env.rolled_out("iptables"):  # the module's first test left it in nftables
        switch(env, "nftables", "iptables", LoadOptions(warmup=0.5, settle=0.5))
    refused = env.nodes[1]
    result = switch_with_refusal(env, "iptables", "nftables", refused, hold_for=40.0)
    assert result.traffic_failures() == [], "\n".join(result.traffic_failures())
    # The refused node's new agent runs but is not Ready; its old rules still serve.
    assert result.agents[refused.name] == "nftables not ready", result.timeline
    assert result.old_rules_kept
    # The rollout stopped there: the ProxyConfiguration is not Ready in the new mode.
    assert result.ready_condition.get("status") != "True", result.ready_condition
    # Once the kernel accepts the agent's rules, the rollout completes.
    assert result.after_lift is not None, result.timeline
    assert env.leftovers("iptables") == {}
